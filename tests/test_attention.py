"""Each fast attention path against its naive twin(s): values, gradients and final states."""

import pytest
import torch
from kinds import N_HEAD, model_rows

from lm import ModelConfig, Transformer
from lm.attention import LayerShape, SlidingSpec, example_rows, linear, reference
from lm.attention.additive import additive_attention, naive_additive_attention
from lm.attention.efficient import (
    EfficientSpec,
    chunked_efficient_attention,
    efficient_step,
    naive_efficient_attention,
    recurrent_efficient_attention,
)
from lm.attention.feature_maps import FEATURE_MAPS, feature_map, taylor_kernel
from lm.attention.gated_delta import GatedDeltaSpec
from lm.attention.kda import KimiDeltaSpec
from lm.attention.linear import (
    LinearSpec,
    chunked_linear_attention,
    chunkwise_flops,
    kernel_linear_attention,
    quadratic_linear_attention,
    recurrent_linear_attention,
)
from lm.attention.lowrank import lowrank_attention, naive_lowrank_attention
from lm.attention.rope import RotaryEmbedding
from lm.attention.sinks import causal_with_learned_sink
from lm.attention.sliding import naive_sliding_window_attention, sliding_window_attention, sliding_with_sinks

HEADS = [(4, 4), (4, 2), (4, 1)]
HEAD_IDS = ["mha", "gqa", "mqa"]


def qkv(n_head, n_kv_head, T, hs=8, seed=0, B=2):
    g = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(B, h, T, hs, generator=g, dtype=torch.float64).requires_grad_()
    return make(n_head), make(n_kv_head), make(n_kv_head)


def assert_same_values_and_grads(fast, naive, inputs, atol=1e-10):
    torch.testing.assert_close(fast, naive, atol=atol, rtol=atol)
    grad_out = torch.randn_like(fast)
    # materialize: an input a path does not use (a compression with no complete block yet) gets zeros
    fast_grads = torch.autograd.grad(fast, inputs, grad_out, retain_graph=True, materialize_grads=True)
    naive_grads = torch.autograd.grad(naive, inputs, grad_out, retain_graph=True, materialize_grads=True)
    for a, b in zip(fast_grads, naive_grads, strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=atol)


@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("T", [1, 5, 16, 33, 64])
@pytest.mark.parametrize("window", [1, 4, 16, 100])
@pytest.mark.parametrize("dilation", [1, 2, 3])
def test_sliding_window_equals_masked_softmax(heads, T, window, dilation):
    q, k, v = qkv(*heads, T, seed=T * 31 + window)
    fast = sliding_window_attention(q, k, v, window, dilation)
    naive = naive_sliding_window_attention(q, k, v, window, dilation)
    assert_same_values_and_grads(fast, naive, (q, k, v))


@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("T, window, dilation, sinks", [(1, 4, 1, 2), (5, 4, 1, 2), (33, 4, 2, 3), (64, 16, 3, 4),
                                                        (17, 100, 1, 4), (40, 3, 1, 6), (40, 3, 2, 1), (12, 2, 1, 0)])
@pytest.mark.parametrize("learned", [False, True], ids=["", "learned-sink"])
def test_sliding_window_with_sinks_equals_masked_softmax(heads, T, window, dilation, sinks, learned):
    q, k, v = qkv(*heads, T, seed=T * 7 + sinks)
    logit = torch.randn(heads[0], dtype=torch.float64, generator=torch.Generator().manual_seed(T)).requires_grad_()
    logit = logit if learned else None
    fast = sliding_with_sinks(q, k, v, window, dilation, sinks, logit)
    naive = naive_sliding_window_attention(q, k, v, window, dilation, sinks, logit)
    assert_same_values_and_grads(fast, naive, (q, k, v) + ((logit,) if learned else ()))


@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("T", [1, 9, 40])
def test_learned_sink_equals_an_extra_logit_in_the_masked_softmax(heads, T):
    q, k, v = qkv(*heads, T, seed=T)
    logit = torch.linspace(-2, 3, heads[0], dtype=torch.float64).requires_grad_()
    fast = causal_with_learned_sink(q, k, v, logit)
    naive = reference.causal_softmax_attention(q, k, v, logit)
    assert_same_values_and_grads(fast, naive, (q, k, v, logit))
    # the sink takes its share: a large logit leaves little for the values
    quiet = causal_with_learned_sink(q, k, v, torch.full((heads[0],), 30.0, dtype=torch.float64))
    assert quiet.abs().max() < 1e-8


@pytest.mark.parametrize("T", [7, 40])
def test_window_covering_the_sequence_is_full_causal_attention(T):
    q, k, v = qkv(4, 2, T)
    torch.testing.assert_close(sliding_window_attention(q, k, v, window=T), reference.causal_softmax_attention(q, k, v))
    torch.testing.assert_close(sliding_window_attention(q, k, v, window=10 * T),
                               reference.causal_softmax_attention(q, k, v))


def featurised(name, n_head, n_kv_head, T, seed=0, state=False):
    q, k, v = qkv(n_head, n_kv_head, T, hs=4, seed=seed)
    phi = feature_map(name)
    fq, fk = phi(q), phi(k)
    init = None
    if state:  # a state as if earlier tokens had been seen
        _, pk, pv = qkv(n_head, n_kv_head, 9, hs=4, seed=seed + 1)
        _, init = recurrent_linear_attention(phi(pk[:, :1].expand(-1, n_head, -1, -1)), phi(pk), pv, 1e-6)
        init = tuple(t.detach() for t in init)
    return (q, k, v), (fq, fk, v), init


@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("name", sorted(FEATURE_MAPS))
@pytest.mark.parametrize("T, chunk", [(1, 4), (7, 4), (16, 4), (33, 8), (20, 64)])
@pytest.mark.parametrize("with_state", [False, True], ids=["fresh", "carried-state"])
def test_chunked_linear_attention_equals_both_naive_twins(heads, name, T, chunk, with_state):
    leaves, (fq, fk, v), state = featurised(name, *heads, T, seed=T + chunk, state=with_state)
    fast, (S, z) = chunked_linear_attention(fq, fk, v, 1e-6, state, chunk_size=chunk)
    quadratic, (S_q, z_q) = quadratic_linear_attention(fq, fk, v, 1e-6, state)
    recurrent, (S_r, z_r) = recurrent_linear_attention(fq, fk, v, 1e-6, state)
    torch.testing.assert_close(quadratic, recurrent)  # the two references agree with each other
    torch.testing.assert_close(S_q, S_r)
    torch.testing.assert_close(z_q, z_r)
    torch.testing.assert_close(S, S_q)
    torch.testing.assert_close(z, z_q)
    assert_same_values_and_grads(fast, quadratic, leaves)


@pytest.mark.parametrize("name", sorted(FEATURE_MAPS))
def test_gradients_reach_a_carried_in_linear_state(name):
    """The state (S, z) from earlier tokens gets the same gradient through the chunked path as
    through the quadratic twin, so training across segments would be exact too."""
    leaves, (fq, fk, v), state = featurised(name, 4, 2, 13, seed=5, state=True)
    S0, z0 = (t.clone().requires_grad_() for t in state)
    fast, (S, z) = chunked_linear_attention(fq, fk, v, 1e-6, (S0, z0), chunk_size=4)
    naive, (S_n, z_n) = quadratic_linear_attention(fq, fk, v, 1e-6, (S0, z0))
    g_out, g_S, g_z = torch.randn_like(fast), torch.randn_like(S), torch.randn_like(z)
    wrt = (*leaves, S0, z0)
    fast_grads = torch.autograd.grad((fast, S, z), wrt, (g_out, g_S, g_z), retain_graph=True)
    naive_grads = torch.autograd.grad((naive, S_n, z_n), wrt, (g_out, g_S, g_z))
    for a, b in zip(fast_grads, naive_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    assert fast_grads[3].abs().max() > 0 and fast_grads[4].abs().max() > 0


@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("T, chunk", [(1, 4), (7, 4), (16, 4), (33, 8), (20, 64)])
@pytest.mark.parametrize("spread", [1.0, 30.0], ids=["keys-n(0,1)", "keys-n(0,30)"])
def test_chunked_efficient_attention_equals_both_naive_twins(heads, T, chunk, spread):
    q, k, v = qkv(*heads, T, seed=T + chunk)
    k = (k.detach() * spread).requires_grad_()  # wide keys exercise the running-maximum stabiliser
    fast, _ = chunked_efficient_attention(q, k, v, chunk_size=chunk)
    masked = naive_efficient_attention(q, k, v)
    torch.testing.assert_close(masked, recurrent_efficient_attention(q, k, v))
    assert_same_values_and_grads(fast, masked, (q, k, v))


def test_efficient_state_carries_across_calls_and_steps():
    """Two chunked calls, or one call then single steps, equal one call over the whole sequence."""
    q, k, v = (t.detach() for t in qkv(4, 2, 30, seed=3))
    whole, (N, D, m) = chunked_efficient_attention(q, k, v, chunk_size=8)
    first, state = chunked_efficient_attention(q[:, :, :13], k[:, :, :13], v[:, :, :13], chunk_size=8)
    second, state = chunked_efficient_attention(q[:, :, 13:25], k[:, :, 13:25], v[:, :, 13:25], state, chunk_size=8)
    steps = []
    for t in range(25, 30):
        out, state = efficient_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state)
        steps.append(out)
    torch.testing.assert_close(torch.cat((first, second, *steps), dim=2), whole)
    torch.testing.assert_close(state[0] * torch.exp(state[2])[..., None], N * torch.exp(m)[..., None])


@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("T, block", [(1, 4), (7, 4), (16, 4), (33, 8), (20, 64)])
def test_blocked_additive_attention_equals_the_pairwise_loop(heads, T, block):
    q, k, v = qkv(*heads, T, seed=T + block)
    g = torch.Generator().manual_seed(T)
    w = torch.randn(heads[0], 8, generator=g, dtype=torch.float64).requires_grad_()
    bias = torch.randn(heads[0], 8, generator=g, dtype=torch.float64).requires_grad_()
    fast = additive_attention(q, k, v, w, bias, block)
    naive = naive_additive_attention(q, k, v, w, bias)
    assert_same_values_and_grads(fast, naive, (q, k, v, w, bias))


@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("T, block, rank", [(1, 4, 2), (7, 4, 2), (16, 4, 3), (33, 8, 2), (20, 64, 8), (300, 8, 1)])
def test_lowrank_attention_equals_the_per_query_gather(heads, T, block, rank):
    """300 positions also cross the fast path's groups of queries."""
    q, k, v = qkv(*heads, T, seed=T + block)
    g = torch.Generator().manual_seed(T)
    E, F = (torch.randn(rank, block, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    fast = lowrank_attention(q, k, v, E, F, block)
    naive = naive_lowrank_attention(q, k, v, E, F, block)
    assert_same_values_and_grads(fast, naive, (q, k, v, E, F))


@pytest.mark.parametrize("hs", [1, 4, 16])
def test_taylor_kernel_is_the_dot_product_of_taylor_features(hs):
    q, k, _ = qkv(1, 1, 12, hs=hs, seed=hs)
    phi = feature_map("taylor")
    torch.testing.assert_close(taylor_kernel(q @ k.transpose(-1, -2) / hs**0.5), phi(q) @ phi(k).transpose(-1, -2))


@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("T", [1, 7, 40])
def test_kernel_linear_attention_equals_the_featurised_naive_twin(heads, T):
    """Taylor's kernel form, which never forms a feature, against the masked product of features."""
    q, k, v = qkv(*heads, T, hs=4, seed=T)
    phi = feature_map("taylor")
    fast = kernel_linear_attention(taylor_kernel, q, k, v, 1e-6)
    naive, _ = quadratic_linear_attention(phi(q), phi(k), v, 1e-6)
    assert_same_values_and_grads(fast, naive, (q, k, v))


def test_taylor_layer_takes_the_kernel_form_for_short_sequences_and_the_chunkwise_form_beyond(monkeypatch):
    """Both training paths of one Taylor layer against its naive twin, at a length on each side of
    the switch (at head size 8 and chunks of 4 the kernel form is cheaper up to 34 positions), with
    the path each length took recorded."""
    calls = []
    real = linear.kernel_linear_attention
    monkeypatch.setattr(linear, "kernel_linear_attention", lambda *args: calls.append(args[1].shape[2]) or real(*args))
    spec = LinearSpec(feature_map="taylor", chunk_size=4)
    layer = spec.build(LayerShape(d_model=32, n_head=4, n_kv_head=2, head_dim=8)).double()
    for T, kernel_form in ((20, True), (34, True), (35, False), (120, False)):
        assert spec.kernel_form(T, 8) is kernel_form
        q, k, v = qkv(4, 2, T, hs=8, seed=T)
        assert_same_values_and_grads(layer.attend(q, k, v), layer.naive_attend(q, k, v), (q, k, v), atol=1e-9)
    assert calls == [20, 34]
    assert not LinearSpec(feature_map="elu").kernel_form(8, 8)  # elu has no closed-form kernel


def test_kernel_form_accumulates_half_precision_inputs_in_float32():
    q, k, v = qkv(4, 2, 50, hs=8)
    out = kernel_linear_attention(taylor_kernel, q.bfloat16(), k.bfloat16(), v.bfloat16(), 1e-6)
    assert out.dtype == torch.float32
    phi = feature_map("taylor")
    exact, _ = quadratic_linear_attention(*(phi(t.bfloat16().double()) for t in (q, k)), v.bfloat16().double(), 1e-6)
    torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5)


def test_taylor_flops_follow_the_path_taken():
    spec = LinearSpec(feature_map="taylor", chunk_size=4)
    assert spec.flops(34, 4, 2, 8) == 2 * 4 * (34 * 35 // 2) * (8 + 8 + 1)  # kernel form: the causal pairs
    assert spec.flops(35, 4, 2, 8) == chunkwise_flops(35, 4, 2, 8, 73, 4)  # 1 + 8 + 64 features


def test_linear_attention_accumulates_half_precision_inputs_in_float32():
    _, (fq, fk, v), _ = featurised("elu", 4, 2, 300)
    out, (S, z) = chunked_linear_attention(fq.bfloat16(), fk.bfloat16(), v.bfloat16(), 1e-6, chunk_size=16)
    assert S.dtype == z.dtype == torch.float32
    exact, _ = quadratic_linear_attention(fq.bfloat16().double(), fk.bfloat16().double(),
                                                    v.bfloat16().double(), 1e-6)
    torch.testing.assert_close(out.double(), exact, atol=1e-4, rtol=1e-4)


def test_linear_attention_state_carries_across_calls():
    """Running a sequence in two calls, passing the state, equals running it in one."""
    _, (fq, fk, v), _ = featurised("elu", 4, 2, 50)
    whole, state_whole = chunked_linear_attention(fq, fk, v, 1e-6, chunk_size=8)
    first, state = chunked_linear_attention(fq[:, :, :21], fk[:, :, :21], v[:, :, :21], 1e-6, chunk_size=8)
    second, state = chunked_linear_attention(fq[:, :, 21:], fk[:, :, 21:], v[:, :, 21:], 1e-6, state, chunk_size=8)
    torch.testing.assert_close(torch.cat((first, second), dim=2), whole)
    torch.testing.assert_close(state[0], state_whole[0])


def test_gradcheck_of_sliding_and_linear_fast_paths():
    q, k, v = qkv(2, 1, 9, hs=4, B=1)
    assert torch.autograd.gradcheck(lambda q, k, v: sliding_window_attention(q, k, v, 3, 2), (q, k, v))
    phi = feature_map("elu")

    def linear64(q, k, v):
        # gradcheck needs float64 throughout; the fp32 accumulation is checked above
        return quadratic_linear_attention(phi(q), phi(k), v, 1e-6)[0]

    assert torch.autograd.gradcheck(linear64, (q, k, v))


KINDS = {name: attention for name, (attention, _) in model_rows().items()}  # 2-layer models


@pytest.mark.parametrize("row", list(example_rows()))
@pytest.mark.parametrize("T", [1, 7, 33])
def test_every_kind_equals_its_naive_twin(row, T):
    """The layer's training path against the naive twin its kind declares (`naive_forward`, or
    `naive_attend` under GroupedQKV's projections), in float64: outputs, and gradients to the
    input and to every parameter."""
    spec, example = example_rows()[row]
    torch.manual_seed(T)
    shape = LayerShape(d_model=32, n_head=N_HEAD, n_kv_head=example.n_kv_head or N_HEAD, head_dim=8)
    layer = spec.build(shape).double()
    layer.reset_own_parameters()
    with torch.no_grad():  # parameters away from their initial values, so no gradient is trivially zero
        for name, p in layer.named_parameters():
            if name not in ("qkv.weight", "out.weight"):
                p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(2, T, 32, dtype=torch.float64, requires_grad=True)
    cos, sin = (t.double() for t in RotaryEmbedding(8, 10000.0)(torch.arange(T)))  # (T, hs/2) each
    params = [p for _, p in layer.named_parameters()]
    assert_same_values_and_grads(layer(x, cos, sin), layer.naive_forward(x, cos, sin), (x, *params))


def small_model(attention, n_kv_head=2):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, n_layer=2, d_model=32, n_head=4, n_kv_head=n_kv_head, d_ff=48,
                      max_seq_len=16, attention=attention)
    return Transformer(cfg).eval()


@pytest.mark.parametrize("name", list(KINDS))
@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
def test_every_kind_is_causal(name, n_kv_head):
    m = small_model(KINDS[name], n_kv_head=n_kv_head)
    idx = torch.randint(0, 61, (2, 14))
    changed = idx.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 61
    with torch.no_grad():
        before, after = m(idx), m(changed)
    torch.testing.assert_close(before[:, :9], after[:, :9], atol=1e-6, rtol=0)
    assert (before[:, 9:] - after[:, 9:]).abs().max() > 1e-4


def test_sliding_and_linear_run_past_the_context_but_full_attention_does_not():
    idx = torch.randint(0, 61, (1, 40))  # max_seq_len is 16
    assert small_model(SlidingSpec(window=4))(idx).shape == (1, 40, 61)
    assert small_model("linear")(idx).shape == (1, 40, 61)
    assert small_model(KINDS["efficient"])(idx).shape == (1, 40, 61)
    for attention in ("softmax", KINDS["sliding-global"], KINDS["additive"], KINDS["lowrank"]):
        with pytest.raises(ValueError, match="exceeds max_seq_len=16"):
            small_model(attention)(idx)


def test_generation_state_each_kind_declares():
    def total(model, tokens):
        return sum(b.attn.generation_state().numel(tokens) for b in model.blocks)

    mha, mqa = small_model("softmax", 4), small_model("softmax", 1)
    assert total(mqa, 100) * 4 == total(mha, 100)  # MQA keeps 1/n_head of MHA's K/V
    sliding = small_model(SlidingSpec(window=4, dilation=2))
    assert total(sliding, 1000) == total(sliding, 10_000) == 2 * 2 * (2 * 4 * 2 * 8)  # ring of W*d
    linear = small_model("linear")
    assert total(linear, 10) == total(linear, 10_000) == 2 * 2 * (8 * 8 + 8)  # (S, z) per K/V head
    hybrid = small_model(["linear", "softmax"])
    assert [b.attn.generation_state().kind for b in hybrid.blocks] == ["recurrent", "kv"]


RECURRENT_ROWS = [name for name, (spec, _) in example_rows().items()
                  if isinstance(spec, (LinearSpec, EfficientSpec, GatedDeltaSpec, KimiDeltaSpec))]


@pytest.mark.parametrize("name", RECURRENT_ROWS)
def test_a_recurrent_kernel_keeps_float32_under_bf16_autocast(name):
    """`bf16-mixed` runs every matmul under autocast in bf16, whatever its inputs' dtype, so a state
    carried from chunk to chunk would be rounded to bf16 at each product. The recurrent kinds'
    kernels turn autocast off: on float32 inputs their output under bf16 autocast is the output
    without it, bit for bit (at 150 positions: several chunks)."""
    spec, example = example_rows()[name]
    torch.manual_seed(0)
    layer = spec.build(LayerShape(d_model=32, n_head=N_HEAD, n_kv_head=example.kv_heads(N_HEAD, 2), head_dim=8))
    layer.reset_own_parameters()
    op, inputs = layer.benchmark_op(150)
    expected = op(*inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = op(*inputs)
    assert under_autocast.dtype == torch.float32 and torch.equal(under_autocast, expected)


@pytest.mark.parametrize("n_head, n_kv_head", [(4, 2), (4, 1)], ids=["gqa", "mqa"])
def test_grouped_sdpa_with_repeated_heads_equals_enable_gqa(n_head, n_kv_head):
    """CUDA's masked grouped calls repeat K/V to one head per query head (no fused kernel takes a
    mask with enable_gqa); the repeat must compute what enable_gqa does, values and gradients."""
    from lm.attention.scores import grouped_sdpa

    q, k, v = qkv(n_head, n_kv_head, T=9)
    mask = torch.rand(2, 1, 9, 9, generator=torch.Generator().manual_seed(3)) < 0.7
    mask |= torch.eye(9, dtype=torch.bool)  # every query sees at least itself
    repeated = grouped_sdpa(q, k, v, mask, repeat_groups=True)
    shared = grouped_sdpa(q, k, v, mask, repeat_groups=False)
    assert_same_values_and_grads(repeated, shared, (q, k, v))


@pytest.mark.parametrize("n_head, n_kv_head", [(4, 2), (4, 1)], ids=["gqa", "mqa"])
def test_a_folded_decoding_step_takes_sdpas_output_in_cudas_layout(n_head, n_kv_head, monkeypatch):
    """A decoding step folds a group's queries onto its K/V head (always on CUDA). CUDA's fused
    kernels return SDPA's output as a transposed view (B, nkv, g, hs) of a (B, g, nkv, hs) buffer,
    which `view` cannot regroup into heads (it failed on an H100); here SDPA's output is handed back
    in that layout on the CPU, and the step still computes what enable_gqa does."""
    from lm.attention import scores

    q, k, v = qkv(n_head, n_kv_head, T=9)
    q = q[:, :, -1:]  # (B, nh, 1, hs): one query per head, as in decoding
    mask = torch.ones(1, 1, 1, 9, dtype=torch.bool)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    sdpa = scores.F.scaled_dot_product_attention

    def cuda_layout(*args, **kwargs):
        out = sdpa(*args, **kwargs)  # (B, H, T, hs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, strides of (B, T, H, hs)

    monkeypatch.setattr(scores, "folds", lambda q, nkv: True)
    monkeypatch.setattr(scores.F, "scaled_dot_product_attention", cuda_layout)
    torch.testing.assert_close(scores.softmax_attention(q, k, v, mask=mask), expected)


SDPA_KIND_ROWS = [name for name, (spec, _) in model_rows().items()  # softcapped rows take the explicit path
                  if not isinstance(spec, list) and not getattr(spec, "softcap", None)
                  and type(spec).__name__ in ("SoftmaxSpec", "SlidingSpec", "LatentSpec", "SparseLatentSpec")]


@pytest.mark.parametrize("name", SDPA_KIND_ROWS)
def test_every_tensor_handed_to_sdpa_is_16_byte_aligned_in_bf16(name, monkeypatch):
    """CUDA's fused SDPA kernels read 16-byte vectors and do not check a view's alignment: MLA's
    values as a view dn numbers into each row of kv_up's output (dn = 28 in bf16: 56 bytes) made
    an H100 fault ("misaligned address") or the flash kernel return wrong values. Every q, k, v a
    kind hands SDPA, in training and cached decoding, in bf16, starts on a 16-byte boundary with
    strides of whole 16-byte units (the last dimension's excepted: 1). A head size that is not a
    whole number of 16-byte units SDPA itself sends to its math path, so only the others count."""
    attention, n_kv_head = model_rows()[name]
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, n_layer=1, d_model=64, n_head=4, n_kv_head=n_kv_head, d_ff=64,
                                    max_seq_len=64, attention=attention)).to(torch.bfloat16).eval()
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.extend((q, k, v))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    from lm import generate

    with torch.no_grad():
        model(torch.randint(0, 50, (2, 20)))
        generate(model, [[1, 2, 3, 4, 5], [6, 7, 8]], 3)
    assert seen, f"{name}: no call of scaled_dot_product_attention"
    fused = [t for t in seen if (t.shape[-1] * t.element_size()) % 16 == 0]
    assert fused, f"{name}: SDPA was handed no head size its fused kernels take"
    for t in fused:
        size = t.element_size()
        misaligned = [s for s in t.stride()[:-1] if (s * size) % 16] if t.stride()[-1] == 1 else ["last"]
        assert t.data_ptr() % 16 == 0 and not misaligned, \
            f"{name}: a {tuple(t.shape)} tensor at offset {t.data_ptr() % 16} with strides {t.stride()}"
