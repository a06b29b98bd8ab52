"""The speed paths against the plain ones: compiled decoding, weight-only int8, compiled training.

Compiling takes 10-90 s per model on a 2-core CPU, so one kind runs in `make test` and every kind
under the `slow` marker. The fixed-shape step itself is held for every kind, eagerly, by
tests/test_generation.py (each row as alone; no host read inside the step).
"""

import functools

import pytest
import torch
from conftest import int8_kernels_here, train_small_run
from test_generation import KINDS, VOCAB, make_model

from lm import ModelConfig, Transformer, generate, quantize_int8, stream
from lm.attention import available_kinds
from lm.formats.checkpoint import read_checkpoint
from lm.generation.quantize import (
    KERNELS,
    Int8Linear,
    choose_kernel,
    dynamic_int8_linear,
    quantize_per_channel,
    weight_bytes,
)
from lm.util.errors import GenerationError
from lm.util.hardware import int8_matmul_is_exact


def ragged_prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 17, 9)]


@pytest.mark.slow
def test_compiled_decoding_gives_the_eager_tokens_on_a_ragged_batch():
    torch._dynamo.reset()
    model = make_model("softmax-gqa")
    prompts = ragged_prompts()
    run = stream(model, prompts, 20, compile=True)
    list(run)
    assert run.tokens == generate(model, prompts, 20)
    # the first step's time (its compilation) is reported, as a part of decoding's: 3 rows of 20 tokens
    assert run.stats["new_tokens"] == 3 * 20 and 0 < run.stats["first_step_s"] < run.stats["decode_s"]


@pytest.mark.slow
@pytest.mark.parametrize("name", [*KINDS, "softmax-gqa+conv", "gated_delta+conv"])
def test_every_kind_compiled_gives_the_eager_tokens(name):
    torch._dynamo.reset()  # each kind is a new graph; torch's recompile limit would count them all
    model = make_model(name)
    prompts = ragged_prompts()
    assert generate(model, prompts, 20, compile=True) == generate(model, prompts, 20)


@pytest.mark.slow
def test_compiled_decoding_of_models_with_other_head_counts_in_one_process():
    """A process that compiles decoding for a GQA model at several batch sizes and then for an MHA
    one: torch.compile has made the head count symbolic by then, and SDPA's enable_gqa refused the
    symbolic bool it got (a TypeError); the tokens must be eager's for both."""
    torch._dynamo.reset()
    shape = dict(vocab_size=64, n_layer=1, d_model=32, n_head=4, d_ff=64)
    gqa = Transformer(ModelConfig(**shape, n_kv_head=2, max_seq_len=40)).eval()
    for batch in (1, 4, 8):
        assert generate(gqa, [[1, 2, 3]] * batch, 4, compile=True) == generate(gqa, [[1, 2, 3]] * batch, 4)
    mha = Transformer(ModelConfig(**shape, n_kv_head=4, max_seq_len=80)).eval()
    for batch in (1, 2):
        assert generate(mha, [[1, 2, 3]] * batch, 4, compile=True) == generate(mha, [[1, 2, 3]] * batch, 4)


def test_compiled_decoding_past_the_recompile_limit_runs_eagerly(monkeypatch):
    """A fullgraph function past torch's recompile limit raises instead of running eagerly: with the
    limit at 1, a second model of another shape must still decode, with eager's tokens and a warning."""
    torch._dynamo.reset()
    # The limit is dynamo's (it counts the graphs it traces), whichever backend compiles them; the
    # eager backend skips inductor's C++ build, the test's cost, while its tokens and fallback are the same
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    shape = dict(vocab_size=64, n_layer=1, d_model=32, n_head=4, d_ff=64, max_seq_len=40)
    with torch._dynamo.config.patch(recompile_limit=1):  # torch's own way: put back on leaving
        first = Transformer(ModelConfig(**shape, n_kv_head=2)).eval()
        assert generate(first, [[1, 2, 3]], 4, compile=True) == generate(first, [[1, 2, 3]], 4)
        second = Transformer(ModelConfig(**shape, n_kv_head=4)).eval()
        with pytest.warns(UserWarning, match="recompile limit"):
            run = stream(second, [[1, 2, 3]], 4, compile=True)
            list(run)
    assert run.tokens == generate(second, [[1, 2, 3]], 4)
    assert run.step_fn.fell_back
    torch._dynamo.reset()


def one_layer_model(n_kv_head: int) -> Transformer:
    torch.manual_seed(0)
    shape = dict(vocab_size=64, n_layer=1, d_model=32, n_head=4, d_ff=64, max_seq_len=40)
    return Transformer(ModelConfig(**shape, n_kv_head=n_kv_head)).eval()


def prefill_traced_not_compiled(monkeypatch) -> None:
    """The prefill through dynamo's `eager` backend: traced as compile=true traces it, inductor's cost (seconds
    per prompt width and weights, on a cold cache) left out of tests that are about the decoding step."""
    from lm.generation import compiled

    monkeypatch.setattr(compiled, "compiled_prefill", lambda model: torch.compile(model, dynamic=False,
                                                                                  backend="eager"))


def counting_frozen_backend(monkeypatch) -> list[bool]:
    """compile_mode=max-autotune's compiled function on a backend that records each graph it is given (and
    whether freezing was on while dynamo traced) and runs it as traced: inductor's cost left out, the
    prefill's included (prefill_traced_not_compiled)."""
    import torch._inductor.config as inductor_config

    from lm.generation import compiled

    prefill_traced_not_compiled(monkeypatch)
    traced = []

    def counting(graph, example_inputs):
        traced.append(inductor_config.freezing)
        return graph.forward

    monkeypatch.setattr(compiled, "_frozen_autotuned",
                        lambda: torch.compile(compiled._step_with, fullgraph=True, backend=counting))
    return traced


def test_the_frozen_step_compiles_again_when_the_weights_change(monkeypatch):
    """compile_mode=max-autotune freezes the weights into the graph, whose guards never read their values:
    a step compiled before a change must not decode with the old weights. Each change compiles again, and
    drops the older weights' entries, so a model changed more often than torch's recompile limit still
    decodes compiled. (The counting backend reads the live weights, so the frozen tokens are held to eager's
    by the slow test, with inductor.)"""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    traced = counting_frozen_backend(monkeypatch)
    model = one_layer_model(n_kv_head=2)  # one layer: dynamo traces it five times
    prompts = [[1, 2, 3], [4, 5]]

    def frozen() -> list:
        run = stream(model, prompts, 4, compile=True, compile_mode="max-autotune")
        list(run)
        assert not run.step_fn.fell_back
        return run.tokens

    with torch._dynamo.config.patch(recompile_limit=2):
        assert frozen() == generate(model, prompts, 4) and traced == [True]
        assert inductor_config.freezing is False  # put back after the call
        frozen()
        assert len(traced) == 1  # the same weights: the same graph
        with torch.no_grad():
            model.head.weight.mul_(-1.0)  # an optimizer's step (and load_state_dict) write in place, as this does
        frozen()
        assert len(traced) == 2
        with torch.no_grad():
            model.blocks[0].mlp.down.weight.data = model.blocks[0].mlp.down.weight.data.clone()  # new storage
        frozen()
        assert len(traced) == 3 and all(traced)  # past the limit of 2 without the older entries dropped
    torch._dynamo.reset()


def test_a_frozen_step_that_fails_leaves_freezing_off(monkeypatch):
    import torch._inductor.config as inductor_config

    from lm.generation import compiled

    torch._dynamo.reset()

    def failing(graph, example_inputs):
        raise RuntimeError("no compiler here")

    prefill_traced_not_compiled(monkeypatch)
    monkeypatch.setattr(compiled, "_frozen_autotuned",
                        lambda: torch.compile(compiled._step_with, fullgraph=True, backend=failing))
    with pytest.raises(Exception, match="no compiler here"):
        generate(one_layer_model(n_kv_head=2), [[1, 2, 3]], 3, compile=True, compile_mode="max-autotune")
    assert inductor_config.freezing is False and not compiled._FROZEN_LOCK.locked()
    torch._dynamo.reset()


def test_a_frozen_step_past_the_recompile_limit_runs_eagerly(monkeypatch):
    torch._dynamo.reset()
    traced = counting_frozen_backend(monkeypatch)
    model = one_layer_model(n_kv_head=2)
    with torch._dynamo.config.patch(recompile_limit=1):
        assert generate(model, [[1, 2, 3]], 3, compile=True, compile_mode="max-autotune") == \
            generate(model, [[1, 2, 3]], 3)
        other = one_layer_model(n_kv_head=4)  # another model of another shape: one compile more than the limit
        with pytest.warns(UserWarning, match="recompile limit"):
            run = stream(other, [[1, 2, 3]], 3, compile=True, compile_mode="max-autotune")
            list(run)
    assert run.step_fn.fell_back and run.tokens == generate(other, [[1, 2, 3]], 3) and len(traced) == 1
    torch._dynamo.reset()


def test_compile_mode_is_checked_before_anything_runs():
    from lm.generation.compiled import check_device

    model = make_model("softmax-gqa")
    with pytest.raises(GenerationError, match="compile_mode='fast' must be one of default, max-autotune"):
        generate(model, [[1, 2]], 2, compile=True, compile_mode="fast")
    with pytest.raises(GenerationError, match="compile_mode=max-autotune chooses how compile=true compiles"):
        generate(model, [[1, 2]], 2, compile_mode="max-autotune")
    with pytest.raises(GenerationError, match="compile_mode=max-autotune is for the CPU"):
        check_device("max-autotune", torch.device("cuda"))
    check_device("default", torch.device("cuda"))  # default compiles on every device
    with pytest.raises(GenerationError, match="compile_mode=max-autotune tunes float matmuls"):
        generate(quantize_int8(model, "dequant"), [[1, 2]], 2, compile=True, compile_mode="max-autotune")


@pytest.mark.slow
def test_max_autotune_decoding_gives_the_eager_tokens_and_follows_the_weights():
    """inductor's frozen, autotuned step: eager's tokens, for two models of one shape and after an in-place write."""
    torch._dynamo.reset()
    model, other = make_model("softmax-gqa"), make_model("softmax-gqa")
    with torch.no_grad():
        other.head.weight.mul_(-1.0)
    prompts = ragged_prompts()
    for m in (model, other, model):
        assert generate(m, prompts, 12, compile=True, compile_mode="max-autotune") == generate(m, prompts, 12)
    with torch.no_grad():
        model.head.weight.mul_(-1.0)
    assert generate(model, prompts, 12, compile=True, compile_mode="max-autotune") == generate(model, prompts, 12)
    torch._dynamo.reset()


# Each registered kind at its defaults and one hybrid in the fast tier; their option variants (other
# head counts, chunk sizes, sinks, caps) in the slow tier: tracing takes 1-4 s a model on an AVX2 EPYC.
ONE_GRAPH_FAST = [name for name in KINDS if name in available_kinds()] + ["softmax-gqa", "hybrid-gated-delta-softmax"]


@pytest.mark.parametrize("name", ONE_GRAPH_FAST)
def test_the_training_forward_of_every_kind_is_one_graph(name):
    """No graph breaks: compile=true training compiles the whole forward of every kind."""
    assert_one_training_graph(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in KINDS if name not in ONE_GRAPH_FAST])
def test_the_training_forward_of_every_kinds_variant_is_one_graph(name):
    assert_one_training_graph(name)


def assert_one_training_graph(name):
    torch._dynamo.reset()
    model = make_model(name).train()
    explanation = torch._dynamo.explain(model)(torch.randint(0, VOCAB, (2, 40)))
    assert explanation.graph_break_count == 0, [str(b.reason)[:200] for b in explanation.break_reasons]


# ---------------------------------------------------------------- int8


def test_per_channel_int8_reconstructs_each_row_within_half_a_step():
    weight = torch.randn(37, 29) * torch.logspace(-3, 1, 37)[:, None]  # rows of very different scales
    weight[5] = 0
    q, scales = quantize_per_channel(weight)
    assert q.dtype == torch.int8 and scales.shape == (37,)
    assert q.abs().amax(1)[torch.arange(37) != 5].eq(127).all()  # each row's largest entry uses the range
    error = (q.float() * scales[:, None] - weight).abs()
    assert (error <= scales[:, None] / 2 + 1e-7).all()
    assert error[5].eq(0).all()


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int8pack_mm"), reason="no int8pack kernel in this torch")
def test_the_two_int8_kernels_compute_the_same_product():
    linear = torch.nn.Linear(48, 72, bias=False)
    x = torch.randn(3, 5, 48)
    dequant, packed = Int8Linear(linear, "dequant"), Int8Linear(linear, "int8pack")
    torch.testing.assert_close(packed(x), dequant(x), atol=1e-4, rtol=1e-4)
    # and both are the float product with the rounded weights
    q, scales = quantize_per_channel(linear.weight)
    torch.testing.assert_close(dequant(x), x @ (q.float() * scales[:, None]).T, atol=1e-5, rtol=1e-5)


def rounded_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The naive twin of dynamic and native in float64: each activation row and each weight row
    rounded to its own int8 grid (absmax / 127, a zero row's scale 1), multiplied as floats."""
    def rounded(rows):  # (R, K) -> (R, K) float64 on the row's int8 grid
        absmax = rows.abs().amax(1, keepdim=True)
        step = (absmax / 127).where(absmax > 0, torch.ones_like(absmax))
        return torch.round(rows / step).clamp(-127, 127) * step
    rows = x.reshape(-1, x.shape[-1]).double()  # (M, K)
    out = rounded(rows) @ rounded(weight.double()).T  # (M, N)
    return out.view(*x.shape[:-1], weight.shape[0])


@pytest.mark.parametrize("kernel", int8_kernels_here(("dynamic", "native")))
@pytest.mark.parametrize("features", [96, 40, 130])  # 96: whole AVX2 blocks of 32 bytes; others a tail too
def test_int8_x_int8_kernels_are_the_product_of_the_rounded_activations_and_weights(kernel, features):
    """Their int32 sums are exact, so only float32's last bits differ from the float64 twin. (dynamic
    is refused where torch._int_mm's sums are not: test_an_inexact_int8_matmul_...)"""
    torch.manual_seed(0)
    linear = torch.nn.Linear(features, 42, bias=False)  # 42 outputs: native's blocks of 4 rows and 2 left over
    x = torch.randn(2, 7, features) * torch.logspace(-2, 1, 7)[:, None]  # rows of very different scales
    x[1, 3] = 0  # a zero row: its scale is 1, its output 0
    layer = Int8Linear(linear, kernel)
    out = layer(x)
    assert out.shape == (2, 7, 42) and out[1, 3].eq(0).all()
    torch.testing.assert_close(out.double(), rounded_product(x, linear.weight.float()), atol=1e-5, rtol=1e-5)
    if kernel == "native":  # the C kernel itself at every row count (the layer hands many rows to _int_mm if exact)
        from lm.generation.int8_native import native_int8_linear

        for rows in (x[0, :1], x[0, :3], x):
            by_c = native_int8_linear(rows, layer.weight, layer.scales)
            torch.testing.assert_close(by_c.double(), rounded_product(rows, linear.weight.float()), atol=1e-5,
                                       rtol=1e-5)
        if int8_matmul_is_exact():  # ... which sums the same products: the same floats to the last bit
            assert torch.equal(native_int8_linear(x, layer.weight, layer.scales),
                               dynamic_int8_linear(x, layer.weight, layer.scales))
    # and it stays near the float product: each factor is off by at most half a step of its row
    torch.testing.assert_close(out, linear(x), atol=0.05 * linear(x).abs().max().item(), rtol=0)


@pytest.mark.skipif(not int8_kernels_here(("native",)), reason="no C compiler here to build the native kernel")
def test_the_native_kernel_sums_full_range_bytes_exactly_where_a_saturating_one_would_not():
    """Every byte at +-127 of the same sign: each pair of products is 2 * 127 * 127 = 32258, the most an
    int16 pair sum reaches without the shift to unsigned bytes that makes oneDNN's AVX2 GEMM saturate;
    and one token alone (M = 1), as a decoding step multiplies."""
    from lm.generation.int8_native import native_int8_linear

    signs = torch.where(torch.arange(256) % 3 == 0, -1.0, 1.0)  # (K,) a pattern of +-1
    rows = [signs, -signs, torch.ones(256), -torch.ones(256), signs]  # a block of four rows and one left over
    weight = torch.stack(rows).to(torch.int8) * 127  # (5, 256) int8 at +-127
    x = signs[None]  # (1, 256): rounds to +-127 with step 1/127
    out = native_int8_linear(x, weight, torch.ones(5))  # (1, 5)
    total = float(signs.sum())
    exact = torch.tensor([[256.0, -256.0, total, -total, 256.0]])  # (127 * 127 * sums) * (1/127) * 1 per product
    torch.testing.assert_close(out, exact * 127, rtol=1e-6, atol=0)


@pytest.mark.skipif(not int8_kernels_here(("native",)), reason="no C compiler here to build the native kernel")
def test_the_native_kernel_built_without_avx2_gives_the_same_floats():
    """The plain C loops a CPU without AVX2 gets: the same exact sums, so the same floats to the last bit,
    at whole blocks of four rows and 32 bytes, and at rows and bytes left over."""
    from lm.generation import int8_native

    plain = int8_native.build(("-mno-avx2",))  # the #else branches, whatever the compiler targets by default
    torch.manual_seed(0)
    for rows, features, outputs in [(1, 384, 44), (3, 130, 7), (5, 40, 2)]:
        weight = torch.randn(outputs, features)
        q, scales = quantize_per_channel(weight)
        x = torch.randn(rows, features)
        by_plain = int8_native.run_kernel(plain, x, q, scales)
        torch.testing.assert_close(by_plain.double(), rounded_product(x, weight), atol=1e-5, rtol=1e-5)
        if int8_native.isa_flags():
            assert torch.equal(by_plain, int8_native.native_int8_linear(x, q, scales))


@pytest.mark.skipif(not int8_kernels_here(("native",)), reason="no C compiler here to build the native kernel")
def test_the_native_kernel_takes_any_layout_and_dtype_and_answers_in_the_inputs():
    """The wrapper converts only what is not contiguous float32 already; whatever it is handed, the answer
    is the contiguous float32 one, in x's dtype and shape, and no features sum to zero."""
    from lm.generation.int8_native import native_int8_linear

    torch.manual_seed(0)
    q, scales = quantize_per_channel(torch.randn(9, 40))  # (9, 40) int8, (9,)
    x = torch.randn(2, 3, 40)
    plain = native_int8_linear(x, q, scales)  # (2, 3, 9) float32
    assert plain.shape == (2, 3, 9) and plain.dtype == torch.float32
    wide = torch.randn(3, 2, 80)  # every other feature: a non-contiguous x
    for variant, weight, s in [
        (x.transpose(0, 1).contiguous().transpose(0, 1), q, scales),  # non-contiguous x, same values
        (x, q.t().contiguous().t(), scales),  # non-contiguous weight
        (x, q, scales.double()),  # float64 scales
    ]:
        assert torch.equal(native_int8_linear(variant, weight, s), plain)
    strided = wide[..., ::2]  # (3, 2, 40), not contiguous
    assert torch.equal(native_int8_linear(strided, q, scales), native_int8_linear(strided.contiguous(), q, scales))
    for dtype in (torch.bfloat16, torch.float64):
        out = native_int8_linear(x.to(dtype), q, scales)
        assert out.dtype == dtype and out.shape == (2, 3, 9)
        assert torch.equal(out, native_int8_linear(x.to(dtype).float(), q, scales).to(dtype))
    assert native_int8_linear(torch.randn(0, 40), q, scales).shape == (0, 9)
    no_features = native_int8_linear(torch.randn(3, 0), torch.zeros(5, 0, dtype=torch.int8), torch.ones(5))
    assert torch.equal(no_features, torch.zeros(3, 5))


@pytest.mark.skipif(not int8_kernels_here(("native",)), reason="no C compiler here to build the native kernel")
def test_the_native_kernel_is_one_op_inside_a_compiled_graph(monkeypatch):
    """torch.compile calls it as an operator of its own: no graph break around each matmul."""
    import lm.generation.int8_native as native

    built, calls = native.library(), []

    class Counting:  # the built library, counting the kernel's calls
        def lm_int8_linear(self, *args):
            calls.append(1)
            return built.lm_int8_linear(*args)

    monkeypatch.setattr(native, "library", Counting)
    torch._dynamo.reset()
    model = quantize_int8(make_model("softmax-gqa"), "native")
    explanation = torch._dynamo.explain(model)(torch.randint(0, VOCAB, (1, 3)))  # 3 rows: the C kernel's share
    assert explanation.graph_break_count == 0, [str(b.reason)[:200] for b in explanation.break_reasons]
    assert len(calls) >= len([m for m in model.modules() if isinstance(m, Int8Linear)])  # ... and it ran


@pytest.mark.slow
@pytest.mark.skipif(not int8_kernels_here(("native",)), reason="no C compiler here to build the native kernel")
def test_compiled_native_int8_decoding_gives_its_eager_tokens():
    torch._dynamo.reset()
    model = quantize_int8(make_model("softmax-gqa"), "native")
    prompts = ragged_prompts()
    assert generate(model, prompts, 12, compile=True) == generate(model, prompts, 12)


@pytest.mark.skipif(not int8_kernels_here(("native",)), reason="no C compiler here to build the native kernel")
def test_the_native_kernel_refuses_operands_it_would_read_past_in_one_line():
    from lm.generation.int8_native import native_int8_linear

    weight_float = torch.randn(8, 64)
    q, scales = quantize_per_channel(weight_float)
    for x, weight, s, says in [
        (torch.randn(1, 128), q, scales, r"weight must be int8 of shape \(N, 128\), got torch.int8 \(8, 64\)"),
        (torch.randn(1, 64), q.float(), scales, r"weight must be int8 of shape \(N, 64\), got torch.float32"),
        (torch.randn(1, 64), q, scales[:5], r"scales must have shape \(8,\), got \(5,\)"),
    ]:
        with pytest.raises(ValueError, match=rf"^native int8 linear: {says}"):
            native_int8_linear(x, weight, s)
    x = torch.randn(2, 64)
    torch.set_default_dtype(torch.float64)  # the output buffer is float32 whatever torch's default
    try:
        out = native_int8_linear(x, q, scales)
    finally:
        torch.set_default_dtype(torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), rounded_product(x, weight_float), atol=1e-5, rtol=1e-5)


def test_int8_model_keeps_logits_close_and_holds_int8_matmul_weights():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=300, n_layer=2, d_model=64, n_head=4, n_kv_head=2, d_ff=128,
                                    max_seq_len=64)).eval()
    quantized = quantize_int8(model)  # the default, auto: dynamic with VNNI, else native where it builds
    auto = choose_kernel(torch.device("cpu"))[0]
    assert {m.kernel for m in quantized.modules() if isinstance(m, Int8Linear)} == {auto}
    assert all(not isinstance(m, torch.nn.Linear) for m in quantized.modules())
    assert isinstance(model.head, torch.nn.Linear)  # the original is untouched
    idx = torch.randint(0, 300, (2, 30))
    with torch.no_grad():
        full, approx = model(idx), quantized(idx)
    # The tolerance lm.generation.quantize documents: within 5% of the logits' spread.
    assert (approx - full).abs().max() <= 0.05 * full.std()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    int8_bytes = sum(m.weight.numel() + 4 * m.out_features for m in linears)  # int8 weights + a scale per row
    # Untied matmul weights leave as float and come back as int8; the tied head is new bytes,
    # since the embedding it shared stays float.
    untied_float_bytes = sum(4 * m.weight.numel() for m in linears if m is not model.head)
    assert weight_bytes(quantized) == weight_bytes(model) - untied_float_bytes + int8_bytes


@pytest.mark.parametrize("kernel", int8_kernels_here(KERNELS))
def test_an_int8_linear_with_a_bias_adds_it_in_float_after_the_matmul(kernel):
    """KDA's gate projection has a bias (gate_bias=true, its default): the int8 layer keeps it float."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 24, bias=True)
    torch.nn.init.uniform_(linear.bias, -3, 3)  # large beside the product: a lost bias cannot hide in the tolerance
    x = torch.randn(3, 5, 32)
    layer = Int8Linear(linear, kernel)
    assert layer.bias.dtype == torch.float32 and torch.equal(layer.bias, linear.bias.detach())
    without = Int8Linear(torch.nn.Linear(32, 24, bias=False), kernel)
    without.weight.copy_(layer.weight)
    without.scales.copy_(layer.scales)
    torch.testing.assert_close(layer(x), without(x) + linear.bias.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(layer(x), linear(x), atol=0.05 * linear(x).abs().max().item(), rtol=0)


def test_a_kda_model_at_its_defaults_quantizes_to_int8_and_keeps_its_logits_close():
    """At random initialisation KDA's int8 logits are off by 12-14% of their spread on seeds 0-2, where
    softmax's are 3.5-4% and gated delta's 4.5-4.9% (lm.generation.quantize): its Q/K/V and output
    projections' rounding alone moves them 9% and 8%, the gate's bias none of it."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=200, n_layer=2, d_model=64, n_head=4, n_kv_head=4, d_ff=128,
                                    max_seq_len=64, attention="kda")).eval()
    assert any(m.bias is not None for m in model.modules() if isinstance(m, torch.nn.Linear))  # the gate's
    quantized = quantize_int8(model)
    assert all(not isinstance(m, torch.nn.Linear) for m in quantized.modules())
    idx = torch.randint(0, 200, (2, 24))
    with torch.no_grad():
        full, approx = model(idx), quantized(idx)
    assert (approx - full).abs().max() <= 0.15 * full.std()


NO_COMPILER = "lm's native int8 kernel cannot be built here: no C compiler found ('cc'; set CC to one)"


@pytest.mark.parametrize("device, int8_instructions, native_builds, exact, kernel, says", [
    ("cpu", True, True, True, "dynamic", "torch._int_mm's int8 x int8 matmuls on the CPU's int8 dot-product "
                                         "instructions (this CPU: "),
    ("cpu", False, True, True, "native", "lm's C kernel of exact int8 x int8 sums, for a CPU without int8 "
                                         "dot-product instructions (AVX512-VNNI, AMX) or whose torch._int_mm is "
                                         "not exact (this CPU: "),
    ("cpu", True, True, False, "native", "lm's C kernel of exact int8 x int8 sums"),  # VNNI, but oneDNN held back
    ("cpu", False, False, True, "dynamic", f"torch._int_mm's int8 x int8 matmuls ({NO_COMPILER}; this CPU: "),
    ("cpu", False, False, False, "int8pack", f"{NO_COMPILER}, and this CPU's int8 x int8 matmul does not return "
                                             "exact sums (this CPU: "),
    ("cuda", False, True, True, "dequant", "the kernel that runs a decoding step on cuda"),
    ("mps", False, True, True, "dequant", "the kernel that runs a decoding step on mps"),  # not native: CPU only
])
def test_the_auto_kernel_follows_what_the_cpu_can_build_and_multiply_and_says_why(
        device, int8_instructions, native_builds, exact, kernel, says, monkeypatch):
    import lm.generation.int8_native
    import lm.util.hardware
    from lm.generation.quantize import resolve_kernel

    monkeypatch.setattr(lm.util.hardware, "cpu_multiplies_int8", lambda: int8_instructions)
    monkeypatch.setattr(lm.generation.int8_native, "unavailable", lambda: None if native_builds else NO_COMPILER)
    monkeypatch.setattr(lm.util.hardware, "int8_matmul_is_exact", lambda: exact)
    chosen, why = resolve_kernel("auto", torch.device(device))
    assert chosen == kernel and why.startswith(f"int8_kernel=auto: {kernel}") and says in why and "\n" not in why
    assert resolve_kernel("dequant", torch.device(device)) == ("dequant", None)  # a named kernel is taken as named


@pytest.mark.parametrize("int8_instructions, exact, rows, by_int_mm", [
    (True, True, 14, True), (True, True, 4, False),  # VNNI: oneDNN's blocked GEMM above NATIVE_MAX_ROWS
    (False, True, 14, False),  # exact but without int8 dot-product instructions: slow (an AVX2 EPYC)
    (True, False, 14, False),  # not exact: never
])
def test_native_hands_many_rows_to_torch_int_mm_only_where_that_is_exact_and_has_int8_instructions(
        int8_instructions, exact, rows, by_int_mm, monkeypatch):
    import lm.generation.quantize
    import lm.util.hardware

    monkeypatch.setattr(lm.util.hardware, "cpu_multiplies_int8", lambda: int8_instructions)
    monkeypatch.setattr(lm.util.hardware, "int8_matmul_is_exact", lambda: exact)
    calls = []

    def through_int_mm(x, weight, scales):
        calls.append(x)
        return x.new_zeros(len(x), len(weight))

    monkeypatch.setattr(lm.generation.quantize, "dynamic_int8_linear", through_int_mm)
    monkeypatch.setattr(lm.generation.quantize, "native_int8_linear", lambda x, w, s: x.new_zeros(len(x), len(w)))
    layer = Int8Linear(torch.nn.Linear(16, 8, bias=False), "native")
    layer(torch.randn(rows, 16))
    assert bool(calls) == by_int_mm


def test_native_is_refused_in_one_line_off_the_cpu_and_without_a_compiler(monkeypatch):
    import lm.generation.int8_native
    from lm.generation.quantize import resolve_kernel

    with pytest.raises(GenerationError, match=r"^int8 kernel=native runs on the CPU; on cuda choose int8_kernel=auto "
                                              r"or dequant$"):
        resolve_kernel("native", torch.device("cuda"))
    monkeypatch.setattr(lm.generation.int8_native, "unavailable", lambda: NO_COMPILER)
    with pytest.raises(GenerationError, match=r"^int8 kernel=native: lm's native int8 kernel cannot be built here: no "
                                              r"C compiler found \('cc'; set CC to one\); choose int8_kernel=auto, "
                                              r"dequant or int8pack$"):
        resolve_kernel("native", torch.device("cpu"))


def test_an_inexact_int8_matmul_is_found_and_dynamic_refused_in_one_line(monkeypatch):
    """oneDNN's int8 GEMM without int8 dot-product instructions (AVX2) saturates its int16 pair sums:
    torch._int_mm's results were wrong for 83-100% of the outputs with oneDNN held to AVX2. Here a
    torch._int_mm that computes as such a kernel does: the check finds it, `auto` takes int8pack
    where the native kernel cannot be built, and `dynamic` named outright is refused in one line, by
    generate's and serve's resolve_kernel."""
    import lm.generation.int8_native
    import lm.util.hardware
    from lm.generation.quantize import resolve_kernel

    def saturating(a, b):
        """(M, K) int8 @ (K, N) int8 -> (M, N) int32 as vpmaddubsw does it: a shifted to unsigned
        (a + 128), byte products added in pairs into int16 with saturation, the shift taken back."""
        M, K, N = *a.shape, b.shape[1]
        products = (a.long() + 128)[:, :, None] * b.long()[None]  # (M, K, N)
        pairs = products.view(M, K // 2, 2, N).sum(2).clamp(-2**15, 2**15 - 1)  # (M, K/2, N): int16 sums
        return (pairs.sum(1) - 128 * b.long().sum(0)).int()

    assert lm.util.hardware.int8_matmul_is_exact.__wrapped__() == int8_matmul_is_exact()  # the cached answer
    monkeypatch.setattr(torch, "_int_mm", saturating)
    assert not lm.util.hardware.int8_matmul_is_exact.__wrapped__()
    monkeypatch.setattr(lm.util.hardware, "int8_matmul_is_exact", lm.util.hardware.int8_matmul_is_exact.__wrapped__)
    monkeypatch.setattr(lm.generation.int8_native, "unavailable", lambda: NO_COMPILER)  # native aside, as without cc
    assert resolve_kernel("auto", torch.device("cpu"))[0] == "int8pack"
    with pytest.raises(GenerationError, match=r"^int8 kernel=dynamic: this CPU's int8 x int8 matmul \(torch._int_mm\) "
                                              r"does not return exact sums .*: choose int8_kernel=auto, dequant or "
                                              r"int8pack$"):
        resolve_kernel("dynamic", torch.device("cpu"))


def test_int8_decoding_agrees_with_fp32_on_a_trained_model(tmp_path, small_corpus):
    """A model trained on real text: the int8 model's next-token argmax equals fp32's at most
    positions of held-out text (the agreement rate is what the README reports at full size)."""
    from lm import load

    path = train_small_run(tmp_path, small_corpus, "trainer.max_steps=30")
    model, tokenizer = load(path)
    text = (small_corpus / sorted(p.name for p in small_corpus.iterdir())[-1]).read_text()[:4000]
    idx = torch.tensor([tokenizer.encode(text).ids[:32]])
    with torch.no_grad():
        # every kernel generate may run here (dynamic is refused where the CPU's int8 matmul is not exact)
        for kernel in int8_kernels_here(KERNELS):
            agree = (model(idx).argmax(-1) == quantize_int8(model, kernel)(idx).argmax(-1)).float().mean().item()
            assert agree >= 0.9, kernel
    prompt = idx[:, :8]
    assert len(generate(quantize_int8(model), prompt, 8)[0]) == 16  # and it decodes through every cache


# ---------------------------------------------------------------- compiled training


@pytest.mark.slow
def test_compiled_training_on_cpu_saves_the_plain_names_and_resumes(tmp_path, small_corpus):
    plain = train_small_run(tmp_path / "plain", small_corpus)
    compiled = train_small_run(tmp_path / "compiled", small_corpus, "compile=true")
    plain_state, compiled_state = (read_checkpoint(p)["state_dict"] for p in (plain, compiled))
    assert list(compiled_state) == list(plain_state)
    for name in plain_state:  # same data, same seed: the same weights up to kernel rounding
        torch.testing.assert_close(compiled_state[name], plain_state[name], atol=2e-3, rtol=2e-3)
    resumed = train_small_run(tmp_path / "compiled", small_corpus, "compile=true", "resume=true",
                              "trainer.max_steps=5")
    assert read_checkpoint(resumed)["global_step"] == 5


def test_a_run_held_to_a_cpu_capability_compiles_into_a_cache_of_its_own(monkeypatch):
    """inductor's on-disk cache does not key CPU code on ATEN_CPU_CAPABILITY: code compiled held to AVX2 and
    loaded by an AVX-512 process aborted it. A held run gets its own folder, unless the user chose one."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from lm.util.hardware import inductor_cache_per_capability

    default = default_cache_dir()
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default)  # what importing torch._inductor.config sets
    assert inductor_cache_per_capability() is None
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "AVX2")
    assert inductor_cache_per_capability() == f"{default}-avx2"
    assert torch._inductor.runtime.cache_dir_utils.cache_dir() == f"{default}-avx2"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/of/the/users")
    assert inductor_cache_per_capability() is None
    assert torch._inductor.runtime.cache_dir_utils.cache_dir() == "/somewhere/of/the/users"
