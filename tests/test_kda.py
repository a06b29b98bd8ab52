"""The KDA rule (lm.attention.kda) against its token-by-token twin and against flash-linear-attention's
naive references (fla-core, a test dependency), in float64: values, gradients and the carried state,
at lengths that are and are not multiples of the chunk, with fewer K/V heads than query heads. Then
the layer's pieces: the decay per channel, a state that continues, strong decays, bad options.

The shared tables (equivalence of the whole layer, causality, caches, ragged batches, host reads,
compile, checkpoints, benchmarks) run the kind's declared examples like every other kind's."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from test_gated_delta import fla_naive, values_and_grads

from lm.attention import LayerShape
from lm.attention.gated_delta import gated_delta_rule, gated_delta_step, recurrent_gated_delta_rule
from lm.attention.kda import KimiDeltaSpec, kda_rule


def inputs(B, nh, nkv, T, hs, dtype, seed=0, with_state=True, strength=2.0):
    """L2-normalised q and k, as the layer gives them; beta in (0, 1), g <= 0 per key channel, a
    carried-in state; all requiring gradients."""
    torch.manual_seed(seed)
    q = F.normalize(torch.randn(B, nh, T, hs, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, nkv, T, hs, dtype=dtype), dim=-1)
    v = torch.randn(B, nkv, T, hs, dtype=dtype)
    beta = torch.rand(B, nkv, T, dtype=dtype)
    g = -strength * torch.rand(B, nkv, T, hs, dtype=dtype)
    state = torch.randn(B, nkv, hs, hs, dtype=dtype) if with_state else None
    tensors = [q, k, v, beta, g] + ([state] if with_state else [])
    for t in tensors:
        t.requires_grad_(True)
    return tensors, state


def assert_same(ours, theirs, tol):
    for a, b in zip((ours[0], ours[1], *ours[2]), (theirs[0], theirs[1], *theirs[2]), strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("T,chunk", [(1, 64), (7, 4), (64, 64), (130, 64), (37, 8), (37, 12)])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("with_state", [True, False], ids=["carried", "fresh"])
def test_the_chunkwise_rule_equals_the_token_by_token_twin_in_float64(T, chunk, heads, with_state):
    tensors, state = inputs(2, *heads, T, 8, torch.float64, seed=T, with_state=with_state)
    q, k, v, beta, g = tensors[:5]
    fast = values_and_grads(lambda: kda_rule(q, k, v, beta, g, state=state, chunk_size=chunk), tensors)
    slow = values_and_grads(lambda: recurrent_gated_delta_rule(q, k, v, beta, g, state=state), tensors)
    assert_same(fast, slow, 1e-10)


def fla_kda_in_float64():
    """fla/ops/kda/naive.py, its arithmetic in float64: it casts every input to `torch.float`, so
    its module sees a torch whose `float` is float64 and is otherwise torch."""
    naive = fla_naive("kda")
    naive.torch = types.SimpleNamespace(**{name: getattr(torch, name) for name in dir(torch)
                                           if not name.startswith("__")})
    naive.torch.float = torch.float64
    return naive


def fla_kda(reference, q, k, v, beta, g, state, chunk_size):
    """fla's reference on our tensors: it has a state per query head and its tensors are (B, T, H, ...),
    so each K/V head's k, v, beta, g and state are repeated for its group; (out, one state per K/V head)."""
    group = q.shape[1] // k.shape[1]
    bthd = lambda t: t.repeat_interleave(group, dim=1).transpose(1, 2)  # noqa: E731  (B, nkv, T, ...) -> (B, T, nh, ...)
    extra = {} if reference.__name__ == "naive_recurrent_kda" else {"chunk_size": chunk_size}
    out, final = reference(q.transpose(1, 2), bthd(k), bthd(v), bthd(g), bthd(beta), **extra,
                           initial_state=state.repeat_interleave(group, dim=1), output_final_state=True)
    return out.transpose(1, 2), final[:, ::group]  # the group's states are equal: one per K/V head


@pytest.mark.parametrize("T", [5, 64, 100])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_the_rule_equals_fla_naive_recurrent_kda_in_float64(T, heads):
    tensors, state = inputs(2, *heads, T, 16, torch.float64, seed=T)
    q, k, v, beta, g = tensors[:5]
    reference = fla_kda_in_float64().naive_recurrent_kda
    theirs = values_and_grads(lambda: fla_kda(reference, q, k, v, beta, g, state, None), tensors)
    ours = values_and_grads(lambda: kda_rule(q, k, v, beta, g, state=state, chunk_size=16), tensors)
    assert theirs[0].dtype == torch.float64
    assert_same(ours, theirs, 1e-10)


@pytest.mark.parametrize("T,chunk", [(16, 16), (64, 16)])
def test_the_rule_equals_fla_naive_chunk_kda_in_float64(T, chunk):
    """fla's chunk form takes only lengths that are multiples of its chunk; ours is given another chunk."""
    tensors, state = inputs(2, 4, 2, T, 8, torch.float64, seed=T)
    q, k, v, beta, g = tensors[:5]
    reference = fla_kda_in_float64().naive_chunk_kda
    theirs = values_and_grads(lambda: fla_kda(reference, q, k, v, beta, g, state, chunk), tensors)
    ours = values_and_grads(lambda: kda_rule(q, k, v, beta, g, state=state, chunk_size=7), tensors)
    assert_same(ours, theirs, 1e-10)


def test_the_rule_equals_fla_naive_recurrent_kda_as_published_in_float32():
    """The reference untouched, in its own float32, against ours given float32 inputs."""
    tensors, state = inputs(2, 4, 2, 100, 16, torch.float32, seed=1)
    q, k, v, beta, g = tensors[:5]
    reference = fla_naive("kda").naive_recurrent_kda
    theirs = values_and_grads(lambda: fla_kda(reference, q, k, v, beta, g, state, None), tensors)
    ours = values_and_grads(lambda: kda_rule(q, k, v, beta, g, state=state), tensors)
    assert_same(ours, theirs, 1e-4)


def test_one_decay_for_every_channel_is_the_gated_delta_rule():
    """KDA with the same log decay in every key channel is Gated DeltaNet's rule."""
    (q, k, v, beta, g, state), _ = inputs(1, 4, 2, 29, 8, torch.float64)
    scalar = g[..., 0].detach()
    ours, ours_state = kda_rule(q, k, v, beta, scalar[..., None].expand_as(g), state=state, chunk_size=8)
    theirs, theirs_state = gated_delta_rule(q, k, v, beta, scalar, state=state, chunk_size=8)
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ours_state, theirs_state, atol=1e-12, rtol=1e-12)


def test_each_channel_keeps_its_own_memory():
    """A key channel with no decay keeps what was written in it; one with a strong decay forgets it."""
    (q, k, v, beta, g), _ = inputs(1, 1, 1, 40, 4, torch.float64, with_state=False)
    g = torch.zeros_like(g).detach()
    g[..., 1] = -30.0  # channel 1 forgets at every step; channel 0 (and 2, 3) never decay
    k = torch.zeros_like(k).detach()
    k[:, :, 0, :] = torch.tensor([0.6, 0.8, 0.0, 0.0], dtype=k.dtype)  # one write at position 0
    beta = torch.ones_like(beta).detach()
    _, S = kda_rule(q.detach(), k, v.detach(), beta, g, chunk_size=16)
    assert torch.allclose(S[0, 0, 0], 0.6 * v[0, 0, 0].detach()) and S[0, 0, 1].abs().max() < 1e-12


def test_strong_decays_stay_finite_and_exact():
    """Log decays of -40 a step sum to -2560 over a chunk of 64: e^(-gamma) would overflow even
    float64; the pairs are formed as e^(gamma_i - gamma_j) <= 1, so nothing does."""
    tensors, state = inputs(1, 2, 2, 150, 8, torch.float32, seed=3, strength=40.0)
    q, k, v, beta, g = tensors[:5]
    out, final = kda_rule(q, k, v, beta, g, state=state)
    assert out.isfinite().all() and final.isfinite().all()
    grads = torch.autograd.grad(out.sum() + final.sum(), tensors)
    assert all(grad.isfinite().all() for grad in grads)
    twin, twin_state = recurrent_gated_delta_rule(*(t.double() for t in (q, k, v, beta, g)), state=state.double())
    torch.testing.assert_close(out.double(), twin, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final.double(), twin_state, atol=1e-5, rtol=1e-5)


def test_a_prefix_state_continues_into_the_rest_and_steps_match():
    """Prefill 20 positions, then 13 chunkwise, then 3 one at a time: the whole sequence's outputs."""
    (q, k, v, beta, g), _ = inputs(1, 4, 2, 36, 8, torch.float64, with_state=False)
    whole, final = kda_rule(q, k, v, beta, g, chunk_size=8)
    first, state = kda_rule(q[:, :, :20], k[:, :, :20], v[:, :, :20], beta[:, :, :20], g[:, :, :20], chunk_size=8)
    second, state = kda_rule(q[:, :, 20:33], k[:, :, 20:33], v[:, :, 20:33], beta[:, :, 20:33], g[:, :, 20:33],
                             state=state, chunk_size=8)
    steps = []
    for t in range(33, 36):
        out, state = gated_delta_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], beta[:, :, t:t + 1],
                                      g[:, :, t:t + 1], 8 ** -0.5, state)
        steps.append(out)
    torch.testing.assert_close(torch.cat((first, second, *steps), dim=2), whole, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(state, final, atol=1e-12, rtol=1e-12)


def test_a_zero_write_and_zero_decay_leave_the_state_alone():
    """What padding relies on: beta = 0 and g = 0 at a position change nothing."""
    (q, k, v, beta, g, state), _ = inputs(1, 2, 2, 5, 8, torch.float64)
    _, after = kda_rule(q, k, v, torch.zeros_like(beta), torch.zeros_like(g), state=state.detach())
    torch.testing.assert_close(after, state.detach(), atol=0, rtol=0)


def test_the_layer_decays_per_channel_and_writes_within_their_ranges():
    layer = KimiDeltaSpec().build(LayerShape(d_model=32, n_head=4, n_kv_head=2, head_dim=8))
    layer.reset_own_parameters()
    _, beta, g = layer._rows(torch.randn(2, 50, 32))
    assert beta.shape == (2, 2, 50) and g.shape == (2, 2, 50, 8)
    assert ((beta > 0) & (beta < 1)).all()
    assert (g <= 0).all() and (g < 0).any()
    assert (g[..., 0] != g[..., 1]).any()  # a decay per key channel, not one per head


@pytest.mark.gpu
def test_the_fla_backend_equals_ours_in_bf16():
    """On CUDA with flash-linear-attention installed: fla's chunk_kda against the chunkwise form
    here, both given bf16 inputs, within bf16's precision."""
    if not torch.cuda.is_available():  # LM_GPU_TIER_DEVICE runs the tier elsewhere: this test needs CUDA itself
        pytest.skip("needs CUDA itself")
    pytest.importorskip("fla.ops.kda", reason="flash-linear-attention is not installed")
    shape = LayerShape(d_model=256, n_head=4, n_kv_head=2, head_dim=64)
    torch.manual_seed(0)
    ours = KimiDeltaSpec().build(shape).cuda().to(torch.bfloat16)
    ours.reset_own_parameters()
    theirs = KimiDeltaSpec(backend="fla").build(shape).cuda().to(torch.bfloat16)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16)
    cos = sin = torch.zeros(300, 32, device="cuda")
    torch.testing.assert_close(theirs(x, cos, sin).float(), ours(x, cos, sin).float(), atol=3e-2, rtol=3e-2)
