"""The output gate, QK-norm and logit softcapping (options of softmax and sliding): each does what
its paper says, the explicit softcapped path equals the naive softmax, and bad values are one line.
The shared tables (tests/kinds.py) run the declared rows through equivalence, causality, caches,
compile and checkpoints; these tests pin what those cannot: that each option acts at all, and where."""

import pytest
import torch

from lm import ConfigError
from lm.attention import LayerShape, SlidingSpec, SoftmaxSpec, layer_specs, spec_from_dict
from lm.attention.reference import masked_softmax_attention
from lm.attention.rope import RotaryEmbedding
from lm.attention.scores import softcapped_attention, softmax_attention

SHAPE = LayerShape(d_model=24, n_head=4, n_kv_head=2, head_dim=6)


def qkv(T: int, S: int, nh: int = 4, nkv: int = 2, scale: float = 3.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    make = lambda heads, n: (torch.randn(2, heads, n, 6, generator=g, dtype=torch.float64) * scale  # noqa: E731
                             ).requires_grad_()
    return make(nh, T), make(nkv, S), make(nkv, S)


def grads(out: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out.square().sum(), inputs)


@pytest.mark.parametrize("nh, nkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("mask_kind", ["causal", "2d", "per-row"])
def test_softcapped_path_equals_the_naive_capped_softmax_in_values_and_gradients(nh, nkv, mask_kind):
    T = 7
    q, k, v = qkv(T, T, nh, nkv)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    band = causal & ~torch.ones(T, T, dtype=torch.bool).tril(-3)  # a window of 3
    per_row = torch.stack([causal, band])[:, None]  # (B, 1, T, T): a different rule per batch row
    kwargs = {"causal": {"causal": True}, "2d": {"mask": band}, "per-row": {"mask": per_row}}[mask_kind]
    visible = {"causal": causal, "2d": band, "per-row": per_row}[mask_kind]
    fast = softcapped_attention(q, k, v, 2.0, **kwargs)
    naive = masked_softmax_attention(q, k, v, visible, softcap=2.0)
    torch.testing.assert_close(fast, naive, atol=1e-12, rtol=1e-12)
    for a, b in zip(grads(fast, q, k, v), grads(naive, q, k, v), strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("nh, nkv", [(4, 2), (4, 1), (6, 3)])
@pytest.mark.parametrize("mask_kind", ["none", "per-row"])
@pytest.mark.parametrize("fold", [True, False])
def test_one_query_per_head_folds_each_group_onto_its_kv_head_and_equals_the_naive_softmax(nh, nkv, mask_kind, fold,
                                                                                           monkeypatch):
    """The decoding step's path (one query per head, grouped K/V): each group's heads as rows of one
    K/V head (or SDPA's enable_gqa where that keeps more threads busy), against the plain per-head
    softmax with K/V copied out to every head."""
    import lm.attention.scores as scores

    monkeypatch.setattr(scores, "folds", lambda q, nkv: fold)
    S = 9
    q, k, v = qkv(1, S, nh, nkv)
    visible = torch.rand(2, 1, 1, S) > 0.4 if mask_kind == "per-row" else torch.ones(1, S, dtype=torch.bool)
    visible[..., 0] = True  # every row sees at least one key
    fast = softmax_attention(q, k, v, mask=visible if mask_kind == "per-row" else None)
    naive = masked_softmax_attention(q, k, v, visible)
    torch.testing.assert_close(fast, naive, atol=1e-12, rtol=1e-12)
    for a, b in zip(grads(fast, q, k, v), grads(naive, q, k, v), strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_the_cap_acts_and_vanishes_as_it_grows():
    q, k, v = qkv(5, 5, scale=4.0)  # scores of several units, so a cap of 1 bends them
    plain = softmax_attention(q, k, v, causal=True)
    assert (softmax_attention(q, k, v, causal=True, softcap=1.0) - plain).abs().max() > 1e-2
    torch.testing.assert_close(softmax_attention(q, k, v, causal=True, softcap=1e6), plain, atol=1e-8, rtol=0)


def rope(T: int, hs: int = 6):
    return tuple(t.double() for t in RotaryEmbedding(hs, 10000.0)(torch.arange(T)))


@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
def test_the_gate_multiplies_each_head_output_before_the_output_projection(gate):
    torch.manual_seed(0)
    plain = SoftmaxSpec().build(SHAPE).double()
    gated = SoftmaxSpec(gate=gate).build(SHAPE).double()
    gated.load_state_dict(plain.state_dict(), strict=False)  # same Q, K, V and output projections
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    cos, sin = rope(5)
    heads = plain.attend(*plain.heads(x, cos, sin)).transpose(1, 2)  # (B, T, nh, hs)
    gates = torch.sigmoid(x @ gated.gate.weight.T).view(2, 5, 4, -1)  # (B, T, nh, 1 or hs): G1 of Qiu et al.
    expected = (heads * gates).flatten(2) @ plain.out.weight.T
    torch.testing.assert_close(gated(x, cos, sin), expected, atol=1e-12, rtol=1e-12)
    assert gated.gate.weight.shape == ((4 if gate == "headwise" else 24), 24)


def test_qk_norm_makes_the_scores_blind_to_the_scale_of_q_and_k():
    """With q and k RMS-normalised per head, scaling x scales only v: the output scales with it
    exactly. Without the norm the scores grow with x and the output changes shape."""
    torch.manual_seed(1)
    x = torch.randn(2, 6, 24, dtype=torch.float64)
    cos, sin = rope(6)
    normed = SoftmaxSpec(qk_norm=True).build(LayerShape(24, 4, 2, 6, norm_eps=1e-30)).double()  # eps out of the way
    with torch.no_grad():
        normed.q_norm.uniform_(0.5, 1.5)
        normed.k_norm.uniform_(0.5, 1.5)
    torch.testing.assert_close(normed(3 * x, cos, sin), 3 * normed(x, cos, sin), atol=1e-12, rtol=1e-12)
    plain = SoftmaxSpec().build(SHAPE).double()
    assert (plain(3 * x, cos, sin) - 3 * plain(x, cos, sin)).abs().max() > 1e-3


def test_qk_norm_normalises_before_rope_with_separate_gains():
    torch.manual_seed(2)
    layer = SoftmaxSpec(qk_norm=True).build(SHAPE).double()
    with torch.no_grad():
        layer.q_norm.copy_(torch.arange(1.0, 7.0))
        layer.k_norm.fill_(2.0)
    x = torch.randn(1, 3, 24, dtype=torch.float64)
    q, k, _ = layer.heads(x, *rope(3, 6))
    # RoPE rotates pairs, so it keeps each head's norm: ||q|| is the normalised row times the gains.
    rows = (x @ layer.qkv.weight.T).view(1, 3, 8, 6).transpose(1, 2)  # (B, nh+2nkv, T, hs)
    unit = rows / rows.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()
    torch.testing.assert_close(q.norm(dim=-1), (unit[:, :4] * torch.arange(1.0, 7.0)).norm(dim=-1))
    torch.testing.assert_close(k.norm(dim=-1), (unit[:, 4:6] * 2).norm(dim=-1))


def test_options_apply_to_global_layers_and_hybrids_only_where_taken():
    layers = layer_specs("sliding", 4, {"window": 8, "softcap": 30.0, "qk_norm": True}, global_every=2)
    assert layers[1] == SoftmaxSpec(softcap=30.0, qk_norm=True)
    assert layers[0] == SlidingSpec(window=8, softcap=30.0, qk_norm=True)
    hybrid = layer_specs(["gated_delta"] * 3 + ["softmax"], 4, {"gate": "elementwise"})
    assert hybrid[3] == SoftmaxSpec(gate="elementwise") and hybrid[0].kind == "gated_delta"


@pytest.mark.parametrize("values, message", [
    ({"kind": "softmax", "gate": "sigmoid"}, "gate='sigmoid' is not one of ['elementwise', 'headwise', 'none']"),
    ({"kind": "sliding", "qk_norm": "yes"}, "qk_norm='yes' must be true or false"),
    ({"kind": "softmax", "softcap": 0}, "softcap=0 must be a positive number"),
    ({"kind": "sliding", "softcap": float("inf")}, "softcap=inf must be finite; null turns capping off"),
    ({"kind": "softmax", "softcap": 30, "learned_sink": True},
     "softcap=30 with learned_sink=true: the sink's logit would be capped with the scores; choose one"),
    ({"kind": "linear", "softcap": 30}, "attention kind 'linear' does not take option(s) ['softcap']"),
    ({"kind": "gated_delta", "qk_norm": True}, "attention kind 'gated_delta' does not take option(s) ['qk_norm']"),
])
def test_bad_option_values_are_one_line_naming_the_option(values, message):
    with pytest.raises(ConfigError) as error:
        spec_from_dict(values)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
