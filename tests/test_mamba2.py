"""Mamba-2's SSD (lm.attention.mamba2) against its token-by-token twin and the quadratic form of the
state space duality in float64, against flash-linear-attention's naive simple-GLA reference (fla-core,
a test dependency), and the layer's pieces: decays and steps within their ranges, a state that
continues, padding that writes nothing, bad options.

The shared tables (equivalence of the whole layer, causality, caches, ragged batches, host reads,
compile, checkpoints, benchmarks) run the kind's declared examples like every other kind's.

Shapes: B batch, nh heads, G groups, T length, P head size, N state size."""

from __future__ import annotations

import pytest
import torch
from test_gated_delta import fla_naive, values_and_grads

from lm.attention import LayerShape, spec_from_dict
from lm.attention.mamba2 import Mamba2Spec, recurrent_ssd, ssd, ssd_step
from lm.util.errors import ConfigError


def inputs(B, nh, G, T, P, N, dtype, seed=0, with_state=True):
    """x and b, c as the layer gives them after SiLU-free random draws, dt > 0, A < 0, a carried-in state."""
    torch.manual_seed(seed)
    x = torch.randn(B, nh, T, P, dtype=dtype)
    dt = torch.rand(B, nh, T, dtype=dtype) * 0.5 + 0.01
    A = -torch.rand(nh, dtype=dtype) * 4 - 0.1
    b, c = torch.randn(B, G, T, N, dtype=dtype), torch.randn(B, G, T, N, dtype=dtype)
    state = torch.randn(B, nh, N, P, dtype=dtype) if with_state else None
    tensors = [x, dt, A, b, c] + ([state] if with_state else [])
    for t in tensors:
        t.requires_grad_(True)
    return tensors, state


def assert_all_close(ours, theirs, atol, rtol, grad_atol=None):
    torch.testing.assert_close(ours[0], theirs[0], atol=atol, rtol=rtol)
    torch.testing.assert_close(ours[1], theirs[1], atol=atol, rtol=rtol)
    for a, b in zip(ours[2], theirs[2], strict=True):
        torch.testing.assert_close(a, b, atol=grad_atol or atol, rtol=rtol)


def quadratic_ssd(x, dt, A, b, c, state):
    """The state space duality's other side (the paper's section 3): y = (L o c b^T)(dt x) with the
    T x T 1-semiseparable mask L_ij = exp(sum_{j<l<=i} dt_l A), plus the carried-in state read with
    the decay up to i; the final state as the sum of every write decayed to the end."""
    nh, G = x.shape[1], b.shape[1]
    b, c = b.repeat_interleave(nh // G, dim=1), c.repeat_interleave(nh // G, dim=1)  # (B, nh, T, N)
    log_a = (dt * A[:, None]).cumsum(-1)  # (B, nh, T): log decay from the start up to each position
    T = x.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    L = (log_a[..., :, None] - log_a[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # (B, nh, T, T)
    v = x * dt[..., None]  # (B, nh, T, P)
    y = (c @ b.transpose(-1, -2) * L) @ v + (c * log_a.exp()[..., None]) @ state
    to_end = (log_a[..., -1:] - log_a).exp()  # (B, nh, T)
    final = log_a[..., -1].exp()[..., None, None] * state + b.transpose(-1, -2) @ (v * to_end[..., None])
    return y, final


@pytest.mark.parametrize("T,chunk", [(1, 64), (7, 4), (64, 64), (130, 64), (37, 8), (24, 8)])
@pytest.mark.parametrize("groups", [(4, 4), (4, 2), (4, 1)], ids=["group-per-head", "two-groups", "one-group"])
@pytest.mark.parametrize("with_state", [True, False], ids=["carried", "fresh"])
def test_the_chunkwise_ssd_equals_the_token_by_token_twin_in_float64(T, chunk, groups, with_state):
    """Values, final state and the gradients of every input (A and the carried state included), at
    lengths that are and are not multiples of the chunk."""
    tensors, state = inputs(2, *groups, T, 8, 6, torch.float64, seed=T, with_state=with_state)
    x, dt, A, b, c = tensors[:5]
    fast = values_and_grads(lambda: ssd(x, dt, A, b, c, state=state, chunk_size=chunk), tensors)
    slow = values_and_grads(lambda: recurrent_ssd(x, dt, A, b, c, state=state), tensors)
    assert_all_close(fast, slow, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("T,chunk", [(9, 4), (40, 16)])
def test_the_chunkwise_ssd_equals_the_quadratic_dual_form_in_float64(T, chunk):
    tensors, state = inputs(2, 4, 2, T, 8, 6, torch.float64, seed=T)
    x, dt, A, b, c = tensors[:5]
    ours = values_and_grads(lambda: ssd(x, dt, A, b, c, state=state, chunk_size=chunk), tensors)
    dual = values_and_grads(lambda: quadratic_ssd(x, dt, A, b, c, state), tensors)
    assert_all_close(ours, dual, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("T", [5, 64, 100])
@pytest.mark.parametrize("reference", ["naive_recurrent_simple_gla", "naive_chunk_simple_gla"])
def test_the_ssd_equals_flash_linear_attentions_naive_simple_gla(T, reference):
    """Mamba-2's SSM is simple GLA (a scalar decay per head) with q = c, k = b, v = dt x, log decay
    dt A and no scaling (the paper's section 5). fla's references compute in float32 whatever their
    inputs (they cast them), with one b, c per head and tensors (B, T, H, d): ours is given the
    heads' b and c and compared within float32's precision, values, final states and gradients."""
    fla = getattr(fla_naive("simple_gla"), reference)
    tensors, state = inputs(2, 4, 4, T, 16, 8, torch.float32, seed=T)
    x, dt, A, b, c = tensors[:5]
    bthd = lambda t: t.transpose(1, 2)  # noqa: E731  (B, H, T, ...) -> (B, T, H, ...)

    def theirs():
        q, k, v, g = bthd(c), bthd(b), bthd(x * dt[..., None]), bthd(dt * A[:, None])
        if reference == "naive_recurrent_simple_gla":
            out, final = fla(q, k, v, g, scale=1.0, initial_state=state, output_final_state=True)
        else:
            out, final = fla(q, k, v, g, initial_state=state, output_final_state=True, chunk_size=16, scale=1.0)
        return bthd(out), final

    ours = values_and_grads(lambda: ssd(x, dt, A, b, c, state=state), tensors)
    assert_all_close(ours, values_and_grads(theirs, tensors), atol=1e-4, rtol=1e-4, grad_atol=5e-4)


def test_a_prefix_state_continues_into_the_rest_and_steps_match():
    """20 positions chunkwise, then 13 more from the state they leave, then 3 one at a time: the whole
    sequence's outputs and final state."""
    (x, dt, A, b, c), _ = inputs(1, 4, 2, 36, 8, 6, torch.float64, with_state=False)
    whole, final = ssd(x, dt, A, b, c, chunk_size=8)
    cut = lambda t, i, j: t[:, :, i:j]  # noqa: E731
    first, state = ssd(*(cut(t, 0, 20) for t in (x, dt)), A, *(cut(t, 0, 20) for t in (b, c)), chunk_size=8)
    second, state = ssd(*(cut(t, 20, 33) for t in (x, dt)), A, *(cut(t, 20, 33) for t in (b, c)), state=state,
                        chunk_size=8)
    steps = []
    for t in range(33, 36):
        out, state = ssd_step(cut(x, t, t + 1), cut(dt, t, t + 1), A, cut(b, t, t + 1), cut(c, t, t + 1), state)
        steps.append(out)
    torch.testing.assert_close(torch.cat((first, second, *steps), dim=2), whole, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(state, final, atol=1e-12, rtol=1e-12)


def test_a_zero_step_leaves_the_state_alone():
    """What padding relies on: dt = 0 at a position neither decays nor writes."""
    (x, dt, A, b, c, state), _ = inputs(1, 2, 1, 5, 8, 4, torch.float64)
    _, after = ssd(x, torch.zeros_like(dt), A, b, c, state=state.detach())
    torch.testing.assert_close(after, state.detach(), atol=0, rtol=0)


def test_the_layer_steps_and_decays_within_their_ranges_and_sizes_from_the_model():
    """dt > 0 and A < 0, so each decay exp(dt A) lies in (0, 1); heads, head size and groups are the
    model's n_head, head_dim and n_kv_head; a fresh layer's dt spans mamba_ssm's [1e-3, 0.1]."""
    layer = Mamba2Spec(d_state=16).build(LayerShape(d_model=32, n_head=4, n_kv_head=2, head_dim=8))
    layer.reset_own_parameters()
    _, rows, dt = layer._project(torch.zeros(1, 3, 32))  # x = 0: dt is softplus(dt_bias)
    assert torch.all((dt > 9e-4) & (dt < 0.11))
    _, _, dt = layer._project(10 * torch.randn(2, 50, 32))
    assert torch.all(dt > 0) and torch.all(layer._A() < 0)  # exp(dt A) < 1 (float32 rounds the smallest to 1)
    x, b, c = layer._ssm_inputs(layer._convolved(rows, None))
    assert x.shape == (1, 4, 3, 8) and b.shape == c.shape == (1, 2, 3, 16)
    assert layer.in_proj.weight.shape == (2 * 32 + 2 * 2 * 16 + 4, 32) and sum(layer.fused_rows()["in_proj.weight"]) \
        == layer.in_proj.weight.shape[0]


@pytest.mark.parametrize("options,message", [
    ({"d_state": 0}, "d_state=0 must be an integer >= 1"),
    ({"chunk_size": 2.5}, "chunk_size=2.5 must be an integer >= 1"),
    ({"conv_size": -1}, "conv_size=-1 must be an integer >= 0"),
])
def test_a_bad_option_is_one_line_naming_it(options, message):
    with pytest.raises(ConfigError, match=message):
        spec_from_dict({"kind": "mamba2", **options})
