"""MHA -> GQA/MQA conversion by pooling K/V heads."""

import pytest
import torch

from lm import ConfigError, ModelConfig, Transformer
from lm.attention import LinearSpec, SlidingSpec, SoftmaxSpec
from lm.attention.additive import AdditiveSpec
from lm.attention.efficient import EfficientSpec
from lm.attention.lowrank import LowRankSpec
from lm.formats.calibration import attention_inputs
from lm.formats.checkpoint import load, read_checkpoint, save_checkpoint
from lm.formats.convert import align_heads, to_grouped
from lm.formats.weights import split_qkv

BASE = dict(vocab_size=61, n_layer=2, d_model=48, n_head=6, d_ff=64, max_seq_len=32)


def teacher(n_kv_head=6, **overrides):
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**BASE, "n_kv_head": n_kv_head, **overrides})).eval()


def kv_heads(model, layer, which):
    cfg = model.config
    q, k, v = split_qkv(model.blocks[layer].attn.qkv.weight.detach(), cfg.n_head, cfg.n_kv_head, cfg.head_dim)
    return (k if which == "k" else v).view(cfg.n_kv_head, cfg.head_dim, -1), q


@pytest.mark.parametrize("n_kv_head", [3, 2, 1])
@pytest.mark.parametrize("init", ["mean", "first"])
def test_each_group_is_the_mean_or_first_of_its_heads(n_kv_head, init):
    src = teacher()
    state, cfg = to_grouped(src.state_dict(), src.config, n_kv_head, init=init)
    dst = Transformer(cfg)
    dst.load_state_dict(state)
    r = 6 // n_kv_head
    for layer in range(2):
        for which in "kv":
            before, q_before = kv_heads(src, layer, which)
            after, q_after = kv_heads(dst, layer, which)
            for g in range(n_kv_head):
                group = before[g * r:(g + 1) * r]
                expected = group.mean(0) if init == "mean" else group[0]
                assert torch.equal(after[g], expected)
            assert torch.equal(q_before, q_after)  # Q untouched
    for name, tensor in src.state_dict().items():
        if not name.endswith("attn.qkv.weight"):
            assert torch.equal(state[name], tensor), name


def test_random_init_draws_fresh_heads_of_the_model_scale():
    src = teacher()
    state, cfg = to_grouped(src.state_dict(), src.config, 2, init="random", seed=3)
    again, _ = to_grouped(src.state_dict(), src.config, 2, init="random", seed=3)
    k = state["blocks.0.attn.qkv.weight"][48:64]
    assert torch.equal(k, again["blocks.0.attn.qkv.weight"][48:64])  # seeded
    assert abs(k.std().item() - src.config.init_std) < 0.01
    assert not any(torch.equal(k, h) for h in kv_heads(src, 0, "k")[0])


def test_same_head_count_is_the_identity():
    src = teacher()
    state, cfg = to_grouped(src.state_dict(), src.config, 6)
    dst = Transformer(cfg).eval()
    dst.load_state_dict(state)
    idx = torch.randint(0, 61, (2, 20))
    assert torch.equal(dst(idx), src(idx))


@pytest.mark.parametrize("attention", [SoftmaxSpec(), SlidingSpec(window=4), LinearSpec(chunk_size=4),
                                       [LinearSpec(chunk_size=4), SoftmaxSpec()], EfficientSpec(chunk_size=4),
                                       AdditiveSpec(block=4), LowRankSpec(block=4, rank=2)], ids=str)
def test_identical_heads_within_groups_convert_to_the_same_function(attention):
    """An MHA model whose K/V heads repeat within each group is a GQA model in disguise."""
    src = teacher(attention=attention)
    state = src.state_dict()
    hs = 8
    for layer in range(2):
        w = state[f"blocks.{layer}.attn.qkv.weight"]
        q, k, v = split_qkv(w, 6, 6, hs)
        repeat = lambda t: t.view(6, hs, -1)[::3].repeat_interleave(3, dim=0).reshape(48, -1)  # noqa: E731
        state[f"blocks.{layer}.attn.qkv.weight"] = torch.cat((q, repeat(k), repeat(v)))
    src.load_state_dict(state)
    converted, cfg = to_grouped(state, src.config, 2)
    dst = Transformer(cfg).eval()
    dst.load_state_dict(converted)
    idx = torch.randint(0, 61, (2, 20))
    torch.testing.assert_close(dst(idx), src(idx), atol=1e-5, rtol=1e-5)


def test_gqa_to_fewer_groups():
    src = teacher(n_kv_head=2)
    state, cfg = to_grouped(src.state_dict(), src.config, 1)
    assert cfg.n_kv_head == 1
    k_before, _ = kv_heads(src, 1, "k")
    dst = Transformer(cfg)
    dst.load_state_dict(state)
    assert torch.equal(kv_heads(dst, 1, "k")[0][0], k_before.mean(0))


@pytest.mark.parametrize("n_kv_head, message", [
    (4, "n_head=6 is not divisible by n_kv_head=4"),
    (12, "n_head=6 is not divisible by n_kv_head=12"),
    (0, "n_kv_head=0 must be a positive integer"),
])
def test_invalid_targets_fail_in_one_line(n_kv_head, message):
    src = teacher()
    with pytest.raises(ConfigError, match=message):
        to_grouped(src.state_dict(), src.config, n_kv_head)


def test_more_heads_than_the_checkpoint_has_is_refused():
    src = teacher(n_kv_head=2)
    with pytest.raises(ConfigError, match="n_kv_head=3 is more than the checkpoint's 2 K/V heads"):
        to_grouped(src.state_dict(), src.config, 3)
    with pytest.raises(ConfigError, match="init='median' is not one of"):
        to_grouped(src.state_dict(), src.config, 1, init="median")


def test_converted_checkpoint_loads_with_its_provenance(tmp_path):
    src = teacher()
    state, cfg = to_grouped(src.state_dict(), src.config, 2)
    provenance = {"source": "checkpoints/teacher/last.ckpt", "source_step": 500, "init": "mean", "fraction": 0.05}
    path = save_checkpoint(tmp_path / "gqa" / "last.ckpt", state, cfg, tokenizer_json=_tiny_tokenizer_json(),
                           provenance=provenance)
    model, tokenizer = load(path)
    assert model.config.n_kv_head == 2 and tokenizer.get_vocab_size() > 0
    assert read_checkpoint(path)["lm"]["provenance"] == provenance
    assert not list(tmp_path.glob("gqa/*.tmp"))


# Aligned pooling (arXiv 2412.20677): float64 throughout, so "the same function" is checked to 1e-10.
SMALL = dict(vocab_size=61, n_layer=2, d_model=32, n_head=4, d_ff=48, max_seq_len=32)


def parent64(n_kv_head=4, **overrides):
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**SMALL, "n_kv_head": n_kv_head, **overrides})).double().eval()


def calibration(model, seed=1):
    ids = torch.randint(0, 61, (4, 24), generator=torch.Generator().manual_seed(seed))
    return ids, attention_inputs(model, [ids[:2], ids[2:]])


def from_state(config, state):
    model = Transformer(config).double().eval()
    model.load_state_dict(state)
    return model


def head_activations(state, config, x, layer):
    """k and v of every K/V head on the layer inputs x (N, C): (nkv, N, hs) each."""
    _, k, v = split_qkv(state[f"blocks.{layer}.attn.qkv.weight"], config.n_head, config.n_kv_head, config.head_dim)
    return [x @ w.view(config.n_kv_head, config.head_dim, -1).transpose(1, 2) for w in (k, v)]


@pytest.mark.parametrize("n_kv_head, target", [(4, 2), (4, 1), (2, 1)])
@pytest.mark.parametrize("attention", [SoftmaxSpec(), SlidingSpec(window=5), SoftmaxSpec(gate="headwise"),
                                       SoftmaxSpec(learned_sink=True), SoftmaxSpec(softcap=3.0)], ids=str)
def test_aligning_heads_keeps_the_parent_function_exactly(n_kv_head, target, attention):
    parent = parent64(n_kv_head, attention=attention)
    ids, inputs = calibration(parent)
    state = parent.state_dict()
    aligned = align_heads(state, parent.config, inputs, target)
    assert all(torch.equal(state[name], tensor) for name, tensor in parent.state_dict().items())  # input untouched
    assert not torch.equal(aligned["blocks.0.attn.qkv.weight"], state["blocks.0.attn.qkv.weight"])
    fresh = torch.randint(0, 61, (2, 32), generator=torch.Generator().manual_seed(7))  # beyond the calibration
    for tokens in (ids, fresh):
        torch.testing.assert_close(from_state(parent.config, aligned)(tokens), parent(tokens), atol=1e-10, rtol=0)


@pytest.mark.parametrize("n_kv_head, target", [(4, 1), (2, 1)])
def test_aligned_heads_are_closer_to_their_group_reference(n_kv_head, target):
    parent = parent64(n_kv_head)
    _, inputs = calibration(parent)
    aligned = align_heads(parent.state_dict(), parent.config, inputs, target)
    r = n_kv_head // target
    for layer, x in enumerate(inputs):
        before = head_activations(parent.state_dict(), parent.config, x, layer)
        after = head_activations(aligned, parent.config, x, layer)
        for acts_before, acts_after in zip(before, after, strict=True):  # keys, then values
            for j in range(n_kv_head):
                ref = j - j % r
                assert torch.equal(acts_after[ref], acts_before[ref])  # the reference is not rotated
                if j != ref:
                    assert squared_distance(acts_after, j, ref) < squared_distance(acts_before, j, ref)


def squared_distance(acts, j, ref):
    return (acts[j] - acts[ref]).pow(2).sum()


def rotated_copy(state, config, generator):
    """The same function written with every non-first K/V head of the pair-groups (0,1), (2,3) in other
    coordinates: keys rotated per RoPE pair (their query rows alike), values by a random orthogonal
    matrix (folded into the output columns)."""
    nh, nkv, hs = config.n_head, config.n_kv_head, config.head_dim
    state = {name: tensor.clone() for name, tensor in state.items()}
    for layer in range(config.n_layer):
        qkv, out = state[f"blocks.{layer}.attn.qkv.weight"], state[f"blocks.{layer}.attn.out.weight"]
        q, k, v = (rows.reshape(-1, hs, rows.shape[1]) for rows in split_qkv(qkv, nh, nkv, hs))  # (heads, hs, C)
        o = out.view(-1, nh, hs)  # (C, nh, hs)
        for j in range(1, nkv, 2):
            angle = torch.rand(hs // 2, generator=generator, dtype=torch.float64) * 6.28
            readers = slice(j * (nh // nkv), (j + 1) * (nh // nkv))
            k[j], q[readers] = turn_pairs(k[j], angle), turn_pairs(q[readers], angle)
            rotation, _ = torch.linalg.qr(torch.randn(hs, hs, generator=generator, dtype=torch.float64))
            v[j] = rotation @ v[j]
            o[:, readers] = o[:, readers] @ rotation.T
        state[f"blocks.{layer}.attn.qkv.weight"] = torch.cat((q, k, v)).reshape(qkv.shape)
        state[f"blocks.{layer}.attn.out.weight"] = o.reshape(out.shape)
    return state


def turn_pairs(rows, angle):
    """Rows (..., hs, C) whose outputs have dims f and f + hs/2 rotated by angle[f]."""
    c, s = angle.cos()[:, None], angle.sin()[:, None]  # (hs/2, 1)
    first, second = rows.chunk(2, dim=-2)
    return torch.cat((c * first - s * second, s * first + c * second), dim=-2)


def test_aligned_pooling_recovers_a_grouped_model_written_in_rotated_coordinates():
    """An MHA model whose K/V heads repeat within each group is GQA in disguise (the test above);
    rotating one head of each pair hides that from mean-pooling but not from aligned pooling."""
    parent = parent64(4)
    state = parent.state_dict()
    for layer in range(2):  # K/V heads 1 and 3 repeat heads 0 and 2
        w = state[f"blocks.{layer}.attn.qkv.weight"]
        q, k, v = split_qkv(w, 4, 4, 8)
        repeat = lambda t: t.view(4, 8, -1)[::2].repeat_interleave(2, dim=0).reshape(32, -1)  # noqa: E731
        state[f"blocks.{layer}.attn.qkv.weight"] = torch.cat((q, repeat(k), repeat(v)))
    parent.load_state_dict(state)
    disguised = rotated_copy(state, parent.config, torch.Generator().manual_seed(3))
    ids, inputs = calibration(parent)
    torch.testing.assert_close(from_state(parent.config, disguised)(ids), parent(ids), atol=1e-10, rtol=0)
    pooled, cfg = to_grouped(disguised, parent.config, 2, init="aligned", layer_inputs=inputs)
    assert cfg.n_kv_head == 2 and parent.config.n_kv_head == 4
    torch.testing.assert_close(from_state(cfg, pooled)(ids), parent(ids), atol=1e-8, rtol=0)
    meaned, cfg = to_grouped(disguised, parent.config, 2, init="mean")
    assert (from_state(cfg, meaned)(ids) - parent(ids)).abs().max() > 1e-3  # what alignment is for


def test_aligned_init_is_the_mean_of_the_aligned_heads():
    parent = parent64(2)
    _, inputs = calibration(parent)
    pooled, cfg = to_grouped(parent.state_dict(), parent.config, 1, init="aligned", layer_inputs=inputs)
    expected, _ = to_grouped(align_heads(parent.state_dict(), parent.config, inputs, 1), parent.config, 1)
    assert cfg.n_kv_head == 1 and pooled.keys() == expected.keys()
    assert all(torch.equal(pooled[name], expected[name]) for name in pooled)


@pytest.mark.parametrize("overrides, layer_inputs, message", [
    ({}, None, r"^init='aligned' needs layer_inputs: each layer's attention input on calibration tokens"),
    ({}, "one", r"^layer_inputs has 1 entries; the model has n_layer=2$"),
    ({}, "narrow", r"^layer_inputs\[0\] has shape \(10, 31\); expected \(N, d_model=32\)$"),
    ({"attention": [SoftmaxSpec(), SoftmaxSpec(qk_norm=True)]}, "ok",
     r"^layer 1 has qk_norm=True, which aligned init cannot rotate through$"),
    ({"attention": SoftmaxSpec(gate="elementwise")}, "ok",
     r"^layer 0 has gate='elementwise', which aligned init cannot rotate through$"),
    ({"attention": LinearSpec(chunk_size=4)}, "ok",
     r"^layer 0 is of kind 'linear'; aligned init supports \['softmax', 'sliding'\]$"),
])
def test_aligned_init_refuses_what_it_cannot_align_in_one_line(overrides, layer_inputs, message):
    parent = parent64(4, **overrides)
    inputs = {None: None, "one": [torch.randn(10, 32, dtype=torch.float64)],
              "narrow": [torch.randn(10, 31, dtype=torch.float64)] * 2,
              "ok": [torch.randn(10, 32, dtype=torch.float64)] * 2}[layer_inputs]
    with pytest.raises(ConfigError, match=message):
        to_grouped(parent.state_dict(), parent.config, 2, init="aligned", layer_inputs=inputs)


def _tiny_tokenizer_json() -> str:
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).to_str()
