"""MHA -> GQA/MQA conversion by pooling K/V heads."""

import pytest
import torch

from lm import ConfigError, ModelConfig, Transformer
from lm.attention import LinearSpec, SlidingSpec, SoftmaxSpec
from lm.attention.additive import AdditiveSpec
from lm.attention.efficient import EfficientSpec
from lm.attention.lowrank import LowRankSpec
from lm.formats.checkpoint import load, read_checkpoint, save_checkpoint
from lm.formats.convert import to_grouped
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


def _tiny_tokenizer_json() -> str:
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).to_str()
