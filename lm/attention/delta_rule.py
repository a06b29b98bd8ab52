"""The chunkwise delta rule that Gated DeltaNet (lm.attention.gated_delta) and Kimi Delta Attention
(lm.attention.kda) share: the sequence taken in segments, each chunk's UT transform, and the state
carried across chunks. Each kind supplies only what differs, the in-chunk terms of its decay.

Shapes: B batch, T sequence length, nh query heads, nkv K/V heads, g = nh / nkv, hs head size of
keys, hv of values, N chunks of C positions (n of them in a segment), gamma the in-chunk cumulative
log decay: (B, nkv, N, C) with one decay per K/V head, (B, nkv, N, C, hs) with one per key channel.

With S the state before a chunk, e^gamma its decay from the chunk's start (a scalar or a vector of
hs, multiplying the key rows of S) and L[i, j] = b_i k_i . (e^(gamma_i - gamma_j) k_j) for j < i:

    [W_v | W_k] = (I + L)^-1 [diag(b) V | diag(b) K e^gamma]    the UT transform; the writes U = W_v - W_k S
    o_i = (q_i e^gamma_i) S + sum_{j <= i} (q_i . e^(gamma_i - gamma_j) k_j) u_j
    S'  = Diag(e^gamma_C) S + (K e^(gamma_C - gamma))^T U = A S + K_end^T W_v,   A = Diag(e^gamma_C) - K_end^T W_k

What makes it fast on a CPU. The state crosses a chunk as one product, S' = A S + K_end^T W_v,
with A and K_end^T W_v formed for every chunk at once beforehand, so the loop that must run in order
is one small matmul per chunk; the states it leaves are stacked, and the writes and outputs are then
batched products over all chunks. The sequence goes in segments of SEGMENT positions, as linear
attention's does (lm.attention.linear), converted and chunked one at a time: a segment's
intermediates stay in cache, where whole-sequence ones are fresh mappings whose page faults cost
more than their arithmetic. Exponentials never reach subnormal results (decay_factor), where
torch's CPU exp is over ten times slower. Everything accumulates in float32 (float64 stays float64).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lm.attention.shared_caches import accumulation_dtype

SEGMENT = 256  # positions per segment (whole chunks): intermediates of a few hundred KB to a few MB


def state_flops(T: int, n_head: int, n_kv_head: int, hs: int, C: int) -> float:
    """The work outside the in-chunk pairs, per chunk of C: the triangular solve for [W_v | W_k]
    (C^2 x 2hs, half of it), A and K_end^T W_v (C hs^2 each), A S in the loop (hs^3), the writes
    U = W_v - W_k S (C hs^2) and, per query head, the outputs from S and U (C hs^2 + C^2 hs)."""
    per_kv_head = T * C * 2 * hs + 3 * 2 * T * hs * hs + 2 * T * hs * hs * hs // C
    per_q_head = 2 * T * hs * hs + 2 * T * C * hs
    return n_kv_head * per_kv_head + n_head * per_q_head

# A segment's chunks in, the decay's in-chunk terms out. From q (B, nkv, n, g, C, hs), k (B, nkv, n,
# C, hs), beta (B, nkv, n, C) and g, the log decay at each position ((B, nkv, n, C) or (B, nkv, n,
# C, hs)): L (B, nkv, n, C, C), read strictly below its diagonal only; scores (B, nkv, n, g*C, C),
# q_i . e^(gamma_i - gamma_j) k_j on and below it (zero above), its rows (query head, position) in
# q's order; and the decay e^gamma from the chunk's start and e^(gamma_C - gamma) to its end, each
# (B, nkv, n, C, 1) or (B, nkv, n, C, hs), with gamma the in-chunk cumulative log decay.
InChunk = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                   tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def decay_factor(log_decay: torch.Tensor) -> torch.Tensor:
    """e^x for log decays x <= 0 (a positive x, at a masked pair, is taken as 0: its factor 1 is
    masked after), x floored at the log of the dtype's smallest normal number. Below that floor
    exp's result is subnormal or zero, and torch's CPU exp takes a path there over ten times slower
    (three times for -inf), while the floor moves the result by less than that smallest number."""
    floor = math.log(torch.finfo(log_decay.dtype).tiny)
    return log_decay.clamp(floor, 0.0).exp()


def chunkwise_delta_rule(in_chunk: InChunk, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                         g: torch.Tensor, scale: float | None, state: torch.Tensor | None,
                         chunk_size: int, segment: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, nh, T, hs), k (B, nkv, T, hs), v (B, nkv, T, hv), beta (B, nkv, T), g (B, nkv, T) or
    (B, nkv, T, hs) -> out (B, nh, T, hv) in q's dtype, final state (B, nkv, hs, hv) in float32 or
    wider; the decay's terms inside each chunk from `in_chunk`."""
    B, nh, T, hs = q.shape
    hv, dtype = v.shape[-1], accumulation_dtype(q.dtype)
    scale = hs ** -0.5 if scale is None else scale
    S = q.new_zeros(B, k.shape[1], hs, hv, dtype=dtype) if state is None else state.to(dtype)
    # Segments taken from the inputs as they come, converted and chunked one at a time: whole-sequence
    # copies would be fresh mappings (32 MB a tensor at 16k x 8 heads x 64) whose page faults cost more
    # than the work. split, not slicing: its backward writes the segments' gradients into one tensor,
    # where every slice would get a gradient the size of the whole.
    step = chunk_size * max(1, (segment or SEGMENT) // chunk_size)
    outputs = []
    for q_s, k_s, v_s, beta_s, g_s in zip(*(t.split(step, dim=2) for t in (q, k, v, beta, g)), strict=True):
        q_s, k_s, v_s, beta_s, g_s = in_chunks(q_s, k_s, v_s, beta_s, g_s, scale, chunk_size, dtype)
        out, S = delta_rule_segment(*in_chunk(q_s, k_s, beta_s, g_s), q_s, k_s, v_s, beta_s, S)
        outputs.append(out)
    return torch.cat(outputs, dim=2)[:, :, :T].to(q.dtype), S  # (B, nh, T, hv)


def in_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
              scale: float, C: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A segment's q (B, nh, Ts, hs), k, v (B, nkv, Ts, hs), beta (B, nkv, Ts) and g (B, nkv, Ts[, hs])
    in `dtype` and in chunks of C, q times `scale`, the tail padded: q (B, nkv, n, g, C, hs), k, v
    (B, nkv, n, C, hs), beta (B, nkv, n, C), g (B, nkv, n, C[, hs]). Padded positions (zero q, k, v,
    beta and g = 0) write nothing and keep the state."""
    B, nh, Ts, hs = q.shape
    nkv = k.shape[1]
    n, pad = -(-Ts // C), -Ts % C
    q = F.pad(q.to(dtype) * scale, (0, 0, 0, pad)).view(B, nkv, nh // nkv, n, C, hs)  # (B, nkv, g, n, C, hs)
    q = q.transpose(2, 3)  # (B, nkv, n, g, C, hs): a group's query heads, each over the chunk
    k = F.pad(k.to(dtype), (0, 0, 0, pad)).view(B, nkv, n, C, hs)  # (B, nkv, n, C, hs)
    v = F.pad(v.to(dtype), (0, 0, 0, pad)).view(B, nkv, n, C, -1)  # (B, nkv, n, C, hv)
    beta = F.pad(beta.to(dtype), (0, pad)).view(B, nkv, n, C)  # (B, nkv, n, C)
    g = F.pad(g.to(dtype), (0, 0, 0, pad) if g.dim() == 4 else (0, pad))
    return q, k, v, beta, g.view(B, nkv, n, C, *g.shape[3:])  # g (B, nkv, n, C[, hs])


def delta_rule_segment(lower: torch.Tensor, scores: torch.Tensor, decay: torch.Tensor, to_end: torch.Tensor,
                       q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                       S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A segment's n chunks, given their in-chunk terms (lower, scores, decay, to_end) as in_chunk
    returns them and their q, k, v, beta as chunkwise_delta_rule splits them; S (B, nkv, hs, hv) the
    state before -> out (B, nh, n*C, hv), the state after."""
    B, nkv, n, C, hs = k.shape
    group, hv, Z = q.shape[3], v.shape[-1], B * nkv * n  # Z: every chunk of every K/V head, one batch dimension
    k, v, b = k.reshape(Z, C, hs), v.reshape(Z, C, hv), beta.reshape(Z, C, 1)
    decay, to_end = decay.reshape(Z, C, -1), to_end.reshape(Z, C, -1)  # (Z, C, hs or 1)

    # The UT transform: solve (I + L) [W_v | W_k] = [diag(b) V | diag(b) K e^gamma] for the chunks at once;
    # unitriangular: the solver takes the diagonal as ones and reads nothing above it, so L stands for
    # I + L as it is (and its gradient is zero there).
    # Solved transposed, W^T (I + L)^T = rhs^T: the same numbers, and 2.5x faster on a CPU, where the
    # solver takes the right-hand sides as columns and so copies a left solve's rows into them.
    rhs = torch.cat((b * v, b * decay * k), dim=-1)  # (Z, C, hv+hs)
    w = torch.linalg.solve_triangular(lower.reshape(Z, C, C).mT, rhs.mT, upper=True, left=False,
                                      unitriangular=True).mT
    w_v, w_k = w.split((hv, hs), dim=-1)  # the writes are U = W_v - W_k S for the state S before the chunk

    # Across chunks, S' = A S + K_end^T W_v: the only step that runs in order, one matmul per chunk.
    k_to_end = (k * to_end).mT  # (Z, hs, C): keys decayed to the chunk's end
    chunk_decay = decay[:, -1, :].expand(Z, hs)  # (Z, hs): each key row of S
    transition = torch.baddbmm(torch.diag_embed(chunk_decay), k_to_end, w_k, alpha=-1)  # A (Z, hs, hs)
    written = torch.bmm(k_to_end, w_v)  # (Z, hs, hv)
    before, S = [], S.reshape(B * nkv, hs, hv)
    for A_n, written_n in zip(transition.view(B * nkv, n, hs, hs).unbind(1),
                              written.view(B * nkv, n, hs, hv).unbind(1), strict=True):
        before.append(S)
        S = torch.baddbmm(written_n, A_n, S)  # (B*nkv, hs, hv)
    S_before = torch.stack(before, dim=1).view(Z, hs, hv)  # the state each chunk starts from

    # The writes and the outputs, for the chunks at once.
    u = torch.baddbmm(w_v, w_k, S_before, alpha=-1)  # (Z, C, hv)
    q_decayed = (q.reshape(Z, group, C, hs) * decay[:, None]).reshape(Z, group * C, hs)  # (Z, g*C, hs)
    out = torch.baddbmm(q_decayed @ S_before, scores.reshape(Z, group * C, C), u)  # (Z, g*C, hv)
    out = out.view(B, nkv, n, group, C, hv).transpose(2, 3)  # (B, nkv, g, n, C, hv)
    return out.reshape(B, nkv * group, n * C, hv), S.view(B, nkv, hs, hv)  # (B, nh, n*C, hv)
