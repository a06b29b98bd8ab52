"""The gated delta rule (lm.attention.gated_delta) against its token-by-token twin in float64 and
against flash-linear-attention's naive reference (fla-core, a test dependency), and the layer's
pieces: the decay's sign, the write strength's range, a state that continues, bad options.

The shared tables (equivalence of the whole layer, causality, caches, ragged batches, host reads,
compile, checkpoints, benchmarks) run the kind's declared examples like every other kind's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lm.attention import LayerShape, spec_from_dict
from lm.attention.gated_delta import GatedDeltaSpec, gated_delta_rule, gated_delta_step, recurrent_gated_delta_rule
from lm.attention.kda import KimiDeltaSpec
from lm.util.errors import ConfigError


def fla_naive(op: str = "gated_delta_rule"):
    """fla/ops/<op>/naive.py loaded on its own: importing the fla package would import its Triton
    kernels, which need a GPU toolchain. tests/test_kda.py loads fla's KDA reference (op kda) so."""
    found = importlib.util.find_spec("fla")
    assert found is not None, "fla-core is a test dependency: pip install -e '.[dev]'"
    path = Path(found.submodule_search_locations[0]) / "ops" / op / "naive.py"
    module_spec = importlib.util.spec_from_file_location(f"fla_{op}_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def inputs(B, nh, nkv, T, hs, dtype, seed=0, with_state=True):
    """L2-normalised q and k, as the layer gives them; beta in (0, 1), g <= 0, a carried-in state."""
    torch.manual_seed(seed)
    q = F.normalize(torch.randn(B, nh, T, hs, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, nkv, T, hs, dtype=dtype), dim=-1)
    v = torch.randn(B, nkv, T, hs, dtype=dtype)
    beta = torch.rand(B, nkv, T, dtype=dtype)
    g = -2 * torch.rand(B, nkv, T, dtype=dtype)
    state = torch.randn(B, nkv, hs, hs, dtype=dtype) if with_state else None
    tensors = [q, k, v, beta, g] + ([state] if with_state else [])
    for t in tensors:
        t.requires_grad_(True)
    return tensors, state


def values_and_grads(fn, tensors):
    out, final = fn()
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()
                                + final.sum() * 0.1, tensors)
    return out, final, grads


@pytest.mark.parametrize("T,chunk", [(1, 64), (7, 4), (64, 64), (130, 64), (37, 8)])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("with_state", [True, False], ids=["carried", "fresh"])
def test_the_chunkwise_rule_equals_the_token_by_token_twin_in_float64(T, chunk, heads, with_state):
    tensors, state = inputs(2, *heads, T, 8, torch.float64, seed=T, with_state=with_state)
    q, k, v, beta, g = tensors[:5]
    fast = values_and_grads(lambda: gated_delta_rule(q, k, v, beta, g, state=state, chunk_size=chunk), tensors)
    slow = values_and_grads(lambda: recurrent_gated_delta_rule(q, k, v, beta, g, state=state), tensors)
    torch.testing.assert_close(fast[0], slow[0], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(fast[1], slow[1], atol=1e-10, rtol=1e-10)
    for a, b in zip(fast[2], slow[2], strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("T", [5, 64, 100])
@pytest.mark.parametrize("reference", ["naive_recurrent_gated_delta_rule", "naive_chunk_gated_delta_rule"])
def test_the_rule_equals_flash_linear_attentions_naive_reference(T, reference):
    """fla's reference computes in float32 and has as many K/V heads as query heads, its tensors
    (B, T, H, d); ours is given the same heads and compared within float32's precision."""
    fla = getattr(fla_naive(), reference)
    tensors, state = inputs(2, 4, 4, T, 16, torch.float32, seed=T)
    q, k, v, beta, g = tensors[:5]
    bthd = lambda t: t.transpose(1, 2)  # noqa: E731  (B, H, T, ...) -> (B, T, H, ...)
    if reference == "naive_recurrent_gated_delta_rule":
        theirs = lambda: fla(bthd(q), bthd(k), bthd(v), bthd(beta), bthd(g),  # noqa: E731
                             initial_state=state, output_final_state=True)
    else:  # the chunk form takes g before beta
        theirs = lambda: fla(bthd(q), bthd(k), bthd(v), bthd(g), bthd(beta), chunk_size=16,  # noqa: E731
                             initial_state=state, output_final_state=True)
    out, final, grads = values_and_grads(lambda: (lambda o, s: (bthd(o), s))(*theirs()), tensors)
    ours = values_and_grads(lambda: gated_delta_rule(q, k, v, beta, g, state=state), tensors)
    torch.testing.assert_close(ours[0], out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(ours[1], final, atol=2e-5, rtol=1e-4)
    for a, b in zip(ours[2], grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_a_prefix_state_continues_into_the_rest_and_steps_match():
    """Prefill 20 positions, then 13 chunkwise, then 3 one at a time: the whole sequence's outputs."""
    (q, k, v, beta, g), _ = inputs(1, 4, 2, 36, 8, torch.float64, with_state=False)
    whole, final = gated_delta_rule(q, k, v, beta, g, chunk_size=8)
    first, state = gated_delta_rule(q[:, :, :20], k[:, :, :20], v[:, :, :20], beta[:, :, :20], g[:, :, :20],
                                    chunk_size=8)
    second, state = gated_delta_rule(q[:, :, 20:33], k[:, :, 20:33], v[:, :, 20:33], beta[:, :, 20:33],
                                     g[:, :, 20:33], state=state, chunk_size=8)
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
    _, after = gated_delta_rule(q, k, v, torch.zeros_like(beta), torch.zeros_like(g), state=state.detach())
    torch.testing.assert_close(after, state.detach(), atol=0, rtol=0)


def test_the_layer_decays_and_writes_within_their_ranges():
    layer = GatedDeltaSpec().build(LayerShape(d_model=32, n_head=4, n_kv_head=2, head_dim=8))
    layer.reset_own_parameters()
    _, beta, g = layer._rows(10 * torch.randn(2, 50, 32))
    assert beta.shape == g.shape == (2, 2, 50)
    assert ((beta > 0) & (beta < 1)).all()
    assert (g <= 0).all() and (g < 0).any()


DELTA_RULE_SPECS = {"gated_delta": GatedDeltaSpec, "kda": KimiDeltaSpec}  # what the two kinds share, tested once


@pytest.mark.parametrize("kind", DELTA_RULE_SPECS)
def test_the_layer_has_no_rope_and_reads_no_future(kind):
    layer = DELTA_RULE_SPECS[kind](chunk_size=4).build(LayerShape(d_model=32, n_head=4, n_kv_head=2, head_dim=8))
    layer.reset_own_parameters()
    x = torch.randn(1, 12, 32)
    cos, sin = torch.randn(12, 4), torch.randn(12, 4)
    y = layer(x, cos, sin)
    torch.testing.assert_close(layer(x, torch.randn(12, 4), torch.randn(12, 4)), y)  # angles unused
    changed = x.clone()
    changed[:, 7] += 1
    torch.testing.assert_close(layer(changed, cos, sin)[:, :7], y[:, :7])


@pytest.mark.parametrize("options,message", [
    ({"conv_size": -1}, "conv_size=-1 must be an integer >= 0"),
    ({"chunk_size": 0}, "chunk_size=0 must be an integer >= 1"),
    ({"norm_eps": 0}, "norm_eps=0 must be"),
    ({"backend": "triton"}, "backend='triton' is not one of"),
    ({"window": 4}, "attention kind '{kind}' does not take option(s) ['window']"),
])
@pytest.mark.parametrize("kind", DELTA_RULE_SPECS)
def test_bad_options_are_one_line_naming_the_option(kind, options, message):
    with pytest.raises(ConfigError) as refused:
        spec_from_dict({"kind": kind, **options})
    assert message.format(kind=kind) in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("kind", DELTA_RULE_SPECS)
def test_the_fla_backend_without_cuda_is_one_line(kind):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the gpu tier runs the fla backend")
    with pytest.raises(ConfigError, match="backend='fla' .* no CUDA device"):
        DELTA_RULE_SPECS[kind](backend="fla").build(LayerShape(d_model=32, n_head=4, n_kv_head=2, head_dim=8))


@pytest.mark.gpu
def test_the_fla_backend_equals_ours_in_bf16():
    """On CUDA with flash-linear-attention installed: fla's chunk kernel against the chunkwise
    form here, both given bf16 inputs, within bf16's precision."""
    if not torch.cuda.is_available():  # LM_GPU_TIER_DEVICE runs the tier elsewhere: this test needs CUDA itself
        pytest.skip("needs CUDA itself")
    pytest.importorskip("fla.ops.gated_delta_rule", reason="flash-linear-attention is not installed")
    shape = LayerShape(d_model=256, n_head=4, n_kv_head=2, head_dim=64)
    torch.manual_seed(0)
    ours = GatedDeltaSpec().build(shape).cuda().to(torch.bfloat16)
    ours.reset_own_parameters()
    theirs = GatedDeltaSpec(backend="fla").build(shape).cuda().to(torch.bfloat16)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16)
    cos = sin = torch.zeros(300, 32, device="cuda")
    torch.testing.assert_close(theirs(x, cos, sin).float(), ours(x, cos, sin).float(), atol=3e-2, rtol=3e-2)


def test_a_state_dict_that_names_the_output_gate_gate_loads_into_it():
    """The layer once inherited a softmax layer's projections and called its SiLU gate `gate` there;
    weights saved under that name load into `output_gate`, and the layer computes the same."""
    torch.manual_seed(0)
    layer = GatedDeltaSpec(chunk_size=4, conv_size=3).build(LayerShape(24, 4, 2, 6))
    layer.reset_own_parameters()  # A_log, dt_bias and the taps start empty: the Transformer fills them
    old = {("gate.weight" if key == "output_gate.weight" else key): value for key, value in layer.state_dict().items()}
    assert "gate.weight" in old and "output_gate.weight" not in old
    again = GatedDeltaSpec(chunk_size=4, conv_size=3).build(LayerShape(24, 4, 2, 6))
    again.load_state_dict(old)  # strict: no key left over, none missing
    x, angles = torch.randn(2, 7, 24), torch.zeros(7, 3)
    expected = layer(x, angles, angles)
    assert expected.isfinite().all() and torch.equal(again(x, angles, angles), expected)


def test_a_checkpoint_that_names_the_output_gate_gate_loads(tmp_path):
    """The same through lm.load, which compares every weight's name with the config's first."""
    from lm import ModelConfig, Transformer, load
    from lm.data.tokenizer import train_tokenizer
    from lm.formats.checkpoint import save_checkpoint

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=300, n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=64,
                                    attention=[GatedDeltaSpec(chunk_size=4), GatedDeltaSpec(chunk_size=4)]))
    old = {key.replace("attn.output_gate.", "attn.gate."): value for key, value in model.state_dict().items()}
    tokenizer = train_tokenizer(iter(["abc def " * 20]), 300)
    loaded, _ = load(save_checkpoint(tmp_path / "last.ckpt", old, model.config, tokenizer.to_str()))
    idx = torch.randint(0, 300, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(idx), model(idx))
