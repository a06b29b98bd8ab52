"""Low-rank attention after Linformer (Wang et al. 2020), in a causal form.

Shapes: B batch, T queries, S keys, nh query heads, nkv K/V heads, hs head size, L block size,
r rank, P compressed slots.

Linformer attends softmax(Q (E K)^T / sqrt(hs)) (F V) with learned E, F of shape (r, N): every
compressed key mixes all N positions, the future included, so it cannot train a decoder. The
causal form here compresses only what is complete. Positions are cut into blocks of L tokens;
a query attends

- the raw keys of its own block up to itself (exact, causal), and
- r compressed key/value slots for every *completed* earlier block: E K_c and F V_c for block c,
  with E, F of shape (r, L) learned and shared by every block and head.

So query i sees i mod L + 1 raw keys and r * floor(i / L) compressed ones: O(N (L + r N / L))
time and memory instead of O(N^2), and at r / L = 1/8 an eighth of full attention's scores.
Decoding keeps the compressed slots of the completed blocks plus the raw K/V of the current
block, so it is exact against the full forward; it holds r slots per L tokens (preallocated for max_len).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from lm.attention.base import AttentionSpec, Example, LayerShape, register
from lm.attention.cache import CacheContext, CacheSpec
from lm.attention.projections import GroupedQKV
from lm.attention.scores import grouped_sdpa
from lm.util.checks import require_int
from lm.util.errors import ConfigError

QUERY_GROUP = 256  # queries per SDPA call of the fast path: bounds its mask at 256 x (keys in view)


@register("lowrank")
@dataclass(frozen=True)
class LowRankSpec(AttentionSpec):
    """Own block exactly, each completed earlier block through `rank` learned compressed slots."""

    block: int = 64
    rank: int = 8

    examples = {"": Example({"block": 4, "rank": 2}, n_kv_head=2),
                "mqa-odd": Example({"block": 5, "rank": 3}, n_kv_head=1)}

    def check(self) -> None:
        require_int("block", self.block)
        require_int("rank", self.rank)
        if self.rank >= self.block:
            raise ConfigError(f"rank={self.rank} must be less than block={self.block}: compression keeps fewer slots")

    def build(self, shape: LayerShape) -> LowRankAttention:
        return LowRankAttention(self, shape)

    def flops(self, T: int, n_head: int, n_kv_head: int, head_dim: int) -> float:
        L, r = self.block, self.rank
        keys = sum(i % L + 1 + r * (i // L) for i in range(T))  # its own block raw + r slots per earlier block
        return 4 * n_head * head_dim * keys


@dataclass(frozen=True)
class CompressedCacheSpec(CacheSpec):
    """r slots for every block of L positions a sequence can start, plus the raw K/V of one block
    (the one in progress): the fixed buffers LowRankCache decodes in."""

    block: int = 1
    rank: int = 1

    def numel(self, seq_len: int, batch: int = 1) -> int:
        slots = self.rank * -(-seq_len // self.block) + self.block
        return batch * 2 * self.n_kv_head * slots * self.head_dim


class LowRankAttention(GroupedQKV):
    adamw_parameters = ("compress_k", "compress_v")  # (r, L): weights over a block's positions, not features

    def __init__(self, spec: LowRankSpec, shape: LayerShape):
        super().__init__(shape)
        self.block, self.rank = spec.block, spec.rank
        # E and F of Linformer, over one block's positions instead of the whole sequence.
        self.compress_k = nn.Parameter(torch.empty(spec.rank, spec.block))
        self.compress_v = nn.Parameter(torch.empty(spec.rank, spec.block))
        self.reset_own_parameters()

    def reset_own_parameters(self) -> None:
        """Slot s starts as the mean of the s-th of r equal segments of the block: a summary from
        the first step, and distinct slots (equal ones would get equal gradients and stay equal)."""
        with torch.no_grad():
            for E in (self.compress_k, self.compress_v):
                E.copy_(segment_means(self.rank, self.block))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return lowrank_attention(q, k, v, self.compress_k, self.compress_v, self.block)

    def naive_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return naive_lowrank_attention(q, k, v, self.compress_k, self.compress_v, self.block)

    def generation_state(self) -> CacheSpec:
        return CompressedCacheSpec("compressed", self.n_kv_head, self.head_dim, block=self.block, rank=self.rank)

    def build_cache(self, context: CacheContext, max_len: int) -> LowRankCache:
        return LowRankCache(context, self)


def segment_means(rank: int, block: int) -> torch.Tensor:
    """(r, L): row s averages positions l with floor(l r / L) == s."""
    segment = torch.arange(block) * rank // block  # (L,): the segment of each position
    E = (segment[None, :] == torch.arange(rank)[:, None]).float()  # (r, L)
    return E / E.sum(1, keepdim=True)


def compress(x: torch.Tensor, E: torch.Tensor) -> torch.Tensor:
    """The completed blocks of x (B, nkv, S, hs), which starts at a block boundary -> (B, nkv, P, hs),
    r slots per block in block order."""
    B, nkv, S, hs = x.shape
    r, L = E.shape
    n = S // L
    blocks = x[:, :, : n * L].reshape(B, nkv, n, L, hs)  # (B, nkv, n, L, hs)
    return torch.einsum("rl,bhnld->bhnrd", E.to(x.dtype), blocks).reshape(B, nkv, n * r, hs)  # (B, nkv, n*r, hs)


def lowrank_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, E: torch.Tensor, Fv: torch.Tensor,
                      block: int, prior: tuple[torch.Tensor, torch.Tensor] | None = None,
                      q_offset: int = 0) -> torch.Tensor:
    """q (B, nh, T, hs) over k, v (B, nkv, S, hs) -> (B, nh, T, hs).

    k and v start at a block boundary; query t sits at position q_offset + t of them. `prior`
    holds the compressed (keys, values) (B, nkv, P, hs) of the blocks before k's start, which
    every query sees. Training calls it with q_offset 0, S == T and no prior; the cache with
    the raw keys of the current block ahead of the new ones."""
    B, nh, T, hs = q.shape
    r = E.shape[0]
    kc, vc = compress(k, E), compress(v, Fv)  # (B, nkv, n*r, hs): the blocks completed here
    if prior is not None:
        kc, vc = torch.cat((prior[0], kc), dim=2), torch.cat((prior[1], vc), dim=2)
    n_prior = 0 if prior is None else prior[0].shape[2]
    # The block each compressed slot summarises, counting prior blocks as -1 (seen by everyone).
    slot_block = torch.cat((torch.full((n_prior,), -1, device=q.device),
                            torch.arange(kc.shape[2] - n_prior, device=q.device) // r))
    outputs = []
    for start in range(0, T, QUERY_GROUP):
        first_pos, last_pos = q_offset + start, q_offset + min(T, start + QUERY_GROUP) - 1  # Python ints: no sync
        pos = torch.arange(first_pos, last_pos + 1, device=q.device)  # (t,)
        own = pos // block  # (t,)
        # Raw keys in view: from the first query's block to the last query.
        raw = torch.arange(first_pos // block * block, last_pos + 1, device=q.device)  # (s,)
        n_slots = n_prior + last_pos // block * r  # compressed slots any query of the group may see
        keys = torch.cat((kc[:, :, :n_slots], k[:, :, raw]), dim=2)  # (B, nkv, n_slots + s, hs)
        values = torch.cat((vc[:, :, :n_slots], v[:, :, raw]), dim=2)
        sees_slot = slot_block[None, :n_slots] < own[:, None]  # (t, n_slots)
        sees_raw = (raw[None, :] // block == own[:, None]) & (raw[None, :] <= pos[:, None])  # (t, s)
        mask = torch.cat((sees_slot, sees_raw), dim=1)  # (t, n_slots + s)
        outputs.append(grouped_sdpa(q[:, :, start:start + len(pos)], keys, values, mask))
    return torch.cat(outputs, dim=2)


class LowRankCache:
    """Per row: the compressed slots of its completed blocks, (B, nkv, P, hs) for keys and values,
    and the raw K/V of its current block, (B, nkv, L, hs); fixed buffers written in place.

    Blocks count from each row's first real token, so rows of a left-padded batch keep their own
    block boundaries: a row has seen `seen - pad` real tokens, which says how many of its slots
    and raw positions are filled. A chunk therefore advances the rows one at a time."""

    def __init__(self, context: CacheContext, layer: LowRankAttention):
        self.context, self.layer = context, layer
        B, nkv, hs, L, r = context.batch_size, layer.n_kv_head, layer.head_dim, layer.block, layer.rank
        slots = r * -(-context.max_len // L)  # every block a row can start, complete or not
        zeros = lambda n: torch.zeros(B, nkv, n, hs, dtype=context.dtype, device=context.device)  # noqa: E731
        self.kc, self.vc, self.k, self.v = zeros(slots), zeros(slots), zeros(L), zeros(L)
        self.slot_block = torch.arange(slots, device=context.device) // r  # (P,): the block of each slot

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        context, layer, T = self.context, self.layer, q.shape[2]
        L, r = layer.block, layer.rank
        out = q.new_zeros(q.shape)  # padding positions read zeros; nothing sees them
        for b, pad in enumerate(context.row_pad):  # the chunk path works row by row on the host
            first = min(T, max(0, pad - context.seen))  # this chunk's padding comes first
            if first == T:
                continue
            done, raw = divmod(max(0, context.seen - pad), L)  # completed blocks, raw positions held
            keys = torch.cat((self.k[b:b + 1, :, :raw], k[b:b + 1, :, first:]), 2)  # (1, nkv, from block start, hs)
            values = torch.cat((self.v[b:b + 1, :, :raw], v[b:b + 1, :, first:]), 2)
            prior = (self.kc[b:b + 1, :, :done * r], self.vc[b:b + 1, :, :done * r])
            out[b:b + 1, :, first:] = lowrank_attention(q[b:b + 1, :, first:], keys, values, layer.compress_k,
                                                        layer.compress_v, L, prior, q_offset=raw)
            new_kc, new_vc = compress(keys, layer.compress_k), compress(values, layer.compress_v)  # (1, nkv, n*r, hs)
            self.kc[b:b + 1, :, done * r:done * r + new_kc.shape[2]] = new_kc
            self.vc[b:b + 1, :, done * r:done * r + new_vc.shape[2]] = new_vc
            left = keys.shape[2] % L  # positions of the block still in progress
            self.k[b:b + 1, :, :left] = keys[:, :, keys.shape[2] - left:]
            self.v[b:b + 1, :, :left] = values[:, :, keys.shape[2] - left:]
        return out

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Each row writes its raw position and re-compresses its current block into that block's r
        slots at every step: the slots stay hidden until the block is complete, and at its last
        position they hold the whole block, so no step needs to ask which rows just finished one."""
        layer = self.layer
        L, r, hs = layer.block, layer.rank, layer.head_dim
        B, nkv = k.shape[:2]
        row_pos = pos - self.context.pad  # (B,): each row's position among its real tokens
        block, offset = row_pos // L, row_pos % L  # (B,) each
        at = offset[:, None, None, None].expand(B, nkv, 1, hs)  # (B, nkv, 1, hs)
        self.k.scatter_(2, at, k)
        self.v.scatter_(2, at, v)
        slots = (block[:, None] * r + torch.arange(r, device=k.device))[:, None, :, None]  # (B, 1, r, 1)
        slots = slots.expand(B, nkv, r, hs)  # (B, nkv, r, hs)
        self.kc.scatter_(2, slots, torch.einsum("rl,bhld->bhrd", layer.compress_k.to(k.dtype), self.k))
        self.vc.scatter_(2, slots, torch.einsum("rl,bhld->bhrd", layer.compress_v.to(v.dtype), self.v))
        sees_slot = self.slot_block[None, :] < block[:, None]  # (B, P): completed blocks only
        sees_raw = torch.arange(L, device=k.device)[None, :] <= offset[:, None]  # (B, L): this block up to pos
        mask = torch.cat((sees_slot, sees_raw), dim=1)[:, None, None]  # (B, 1, 1, P + L)
        keys, values = torch.cat((self.kc, self.k), dim=2), torch.cat((self.vc, self.v), dim=2)  # (B, nkv, P + L, hs)
        return grouped_sdpa(q, keys, values, mask)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"kc": self.kc, "vc": self.vc, "k": self.k, "v": self.v}


# ------------------------------------------------------------ naive twin (for tests)


def naive_lowrank_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, E: torch.Tensor, F: torch.Tensor,
                      block: int) -> torch.Tensor:
    """Causal low-rank attention query by query: gather the raw keys of its own block up to
    itself and E K_c, F V_c (r slots each) of every completed earlier block c, then softmax."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
    v = v.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
    outputs = []
    for i in range(q.shape[2]):
        own = i // block
        keys = [E @ k[:, :, c * block:(c + 1) * block] for c in range(own)] + [k[:, :, own * block:i + 1]]
        values = [F @ v[:, :, c * block:(c + 1) * block] for c in range(own)] + [v[:, :, own * block:i + 1]]
        keys, values = torch.cat(keys, dim=2), torch.cat(values, dim=2)  # (B, nh, seen, hs)
        scores = (q[:, :, i, None] @ keys.transpose(-1, -2))[:, :, 0] / math.sqrt(q.shape[-1])  # (B, nh, seen)
        outputs.append((scores.softmax(-1)[:, :, None] @ values)[:, :, 0])
    return torch.stack(outputs, dim=2)
