"""Gated DeltaNet to fewer K/V heads: the fused Q/K/V rows and every per-head tensor beside them
(the convolution's K and V channels, W_a and W_b rows, A_log, dt_bias) follow their head, checked
against a per-head loop; a converted checkpoint loads and trains; a tensor of no grouped form is
refused in one line before any weight is pooled."""

from pathlib import Path

import pytest
import torch
from conftest import compose_config, train_small_run

import lm
from lm import ModelConfig, Transformer
from lm.config.uptrain import UptrainRun
from lm.formats import convert
from lm.formats.checkpoint import read_checkpoint
from lm.formats.convert import check_convertible, to_grouped
from lm.training.uptraining import uptrain
from lm.util.errors import ConfigError

NH, HS, C = 6, 8, 48  # query heads, head size, d_model


def parent(n_kv_head: int = 6, conv_size: int = 4) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=61, n_layer=2, d_model=C, n_head=NH, n_kv_head=n_kv_head, d_ff=64,
                         max_seq_len=32, attention={"kind": "gated_delta", "chunk_size": 4, "conv_size": conv_size})
    model = Transformer(config).eval()
    with torch.no_grad():  # distinct per-head values everywhere, so a head taken from the wrong place shows
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias", "conv")):
                p.copy_(torch.randn_like(p) * 0.3)
    return model


def naive_group(heads: list[torch.Tensor], m: int, init: str) -> list[torch.Tensor]:
    """Per group of consecutive heads: their mean, or the first, one head at a time."""
    r = len(heads) // m
    groups = [heads[g * r:(g + 1) * r] for g in range(m)]
    return [sum(group) / len(group) if init == "mean" else group[0] for group in groups]


def per_head(tensor: torch.Tensor, nkv: int, start: int, size: int) -> list[torch.Tensor]:
    """Rows start + h*size .. start + (h+1)*size of `tensor`, for each of nkv heads."""
    return [tensor[start + h * size:start + (h + 1) * size] for h in range(nkv)]


@pytest.mark.parametrize("n_kv_head, m", [(6, 3), (6, 1), (2, 1)])
@pytest.mark.parametrize("init", ["mean", "first"])
def test_every_per_head_tensor_follows_its_head(n_kv_head, m, init):
    src = parent(n_kv_head)
    state, cfg = to_grouped(src.state_dict(), src.config, m, init=init)
    assert cfg.n_kv_head == m
    for layer in range(2):
        before = {k.split(".attn.")[1]: v for k, v in src.state_dict().items() if k.startswith(f"blocks.{layer}.attn.")}
        after = {k.split(".attn.")[1]: v for k, v in state.items() if k.startswith(f"blocks.{layer}.attn.")}
        for name in ("qkv.weight", "conv"):  # [Q heads | K heads | V heads] rows, hs each
            q_rows = NH * HS
            assert torch.equal(after[name][:q_rows], before[name][:q_rows])  # Q untouched
            for part in range(2):  # K, then V
                expected = naive_group(per_head(before[name], n_kv_head, q_rows + part * n_kv_head * HS, HS), m, init)
                got = per_head(after[name], m, q_rows + part * m * HS, HS)
                for e, g in zip(expected, got, strict=True):
                    torch.testing.assert_close(g, e, rtol=0, atol=1e-7)
        for part in range(2):  # W_a rows, then W_b rows: one per head
            expected = naive_group(per_head(before["decay_and_write.weight"], n_kv_head, part * n_kv_head, 1), m, init)
            got = per_head(after["decay_and_write.weight"], m, part * m, 1)
            for e, g in zip(expected, got, strict=True):
                torch.testing.assert_close(g, e, rtol=0, atol=1e-7)
        for name in ("A_log", "dt_bias"):
            expected = torch.stack([t[0] for t in naive_group(per_head(before[name], n_kv_head, 0, 1), m, init)])
            torch.testing.assert_close(after[name], expected, rtol=0, atol=1e-7)
        for name in ("out.weight", "output_gate.weight", "out_norm"):
            assert torch.equal(after[name], before[name])
    dst = Transformer(cfg).eval()
    dst.load_state_dict(state)  # every shape is the grouped model's


def test_identical_heads_within_groups_convert_to_the_same_function():
    """A 6-K/V-head model whose heads repeat within each group of 3, in every per-head tensor, is a
    2-head model in disguise: pooling must give that model, function for function."""
    src = parent(6)
    state = src.state_dict()

    def repeated(tensor, start, size):  # the group's first head copied over the others
        out = tensor.clone()
        for h in range(6):
            first = h - h % 3
            out[start + h * size:start + (h + 1) * size] = tensor[start + first * size:start + (first + 1) * size]
        return out

    for layer in range(2):
        p = f"blocks.{layer}.attn."
        for name in ("qkv.weight", "conv"):
            for part in range(2):
                state[p + name] = repeated(state[p + name], NH * HS + part * 6 * HS, HS)
        for part in range(2):
            state[p + "decay_and_write.weight"] = repeated(state[p + "decay_and_write.weight"], part * 6, 1)
        for name in ("A_log", "dt_bias"):
            state[p + name] = repeated(state[p + name], 0, 1)
    src.load_state_dict(state)
    converted, cfg = to_grouped(state, src.config, 2)
    dst = Transformer(cfg).eval()
    dst.load_state_dict(converted)
    idx = torch.randint(0, 61, (2, 13))
    torch.testing.assert_close(dst(idx), src(idx), atol=1e-5, rtol=1e-5)
    prompts = [[5, 6, 7], [8, 9]]
    assert lm.generate(dst, prompts, 6) == lm.generate(dst, prompts, 6, use_cache=False)  # its recurrent cache


def test_random_init_draws_kv_rows_and_keeps_the_groups_decay():
    src = parent(6)
    state, _ = to_grouped(src.state_dict(), src.config, 2, init="random", seed=1)
    mean, _ = to_grouped(src.state_dict(), src.config, 2, init="mean")
    k_rows = slice(NH * HS, NH * HS + 2 * HS)
    assert not torch.equal(state["blocks.0.attn.qkv.weight"][k_rows], mean["blocks.0.attn.qkv.weight"][k_rows])
    for name in ("conv", "decay_and_write.weight", "A_log", "dt_bias"):
        assert torch.equal(state[f"blocks.0.attn.{name}"], mean[f"blocks.0.attn.{name}"]), name


def test_a_tensor_of_no_grouped_form_is_refused_before_any_weight_is_pooled(monkeypatch):
    """The safety net for a kind whose per-head tensors convert.py does not know (here: gated delta's,
    forgotten): one line naming the tensor, raised before pooling."""
    monkeypatch.setattr(convert, "PER_HEAD_TENSORS", {})
    src = parent(6)
    with pytest.raises(ConfigError) as refused:
        check_convertible(src.config, 2)
    assert str(refused.value) == ("blocks.0.attn.conv (kind 'gated_delta', shape (144, 4)) changes shape with the "
                                  "K/V heads and has no grouped form: the checkpoint cannot be converted to "
                                  "n_kv_head=2")
    with pytest.raises(ConfigError, match="no grouped form"):
        to_grouped(src.state_dict(), src.config, 2)
    check_convertible(src.config, 6)  # the same heads: nothing to convert, nothing refused


def test_aligned_init_is_refused_for_gated_delta_before_reading_data():
    with pytest.raises(ConfigError, match=r"^layer 0 is of kind 'gated_delta'; aligned init supports"):
        check_convertible(parent(6).config, 2, "aligned")


@pytest.fixture(scope="module")
def gated_delta_run(tmp_path_factory, small_corpus) -> Path:
    return train_small_run(tmp_path_factory.mktemp("gd-teacher"), small_corpus, "attn=gated_delta",
                           "attn.chunk_size=8", "trainer.max_steps=4", "trainer.val_every_n_steps=4",
                           "run_name=gd")


def uptrain_config(ckpt, tmp_path, *overrides):
    overrides = [f"ckpt={ckpt}", f"checkpoint_dir={tmp_path}", "logger=none",
                 "progress_bar=false", "sample_tokens=0", *overrides]
    return UptrainRun.from_config(compose_config("uptrain", overrides))


def test_a_gated_delta_checkpoint_converts_to_mqa_and_loads(gated_delta_run, tmp_path):
    result = uptrain(uptrain_config(gated_delta_run, tmp_path, "attn.n_kv_head=1", "uptrain.steps=0",
                                    f"out={tmp_path / 'mqa'}"))
    model, _ = lm.load(result["last"])
    assert model.config.n_kv_head == 1 and model.config.kinds() == ["gated_delta", "gated_delta"]
    assert model.blocks[0].attn.A_log.shape == (1,) and model.blocks[0].attn.conv.shape == ((4 + 2) * 16, 4)
    parent_model, _ = lm.load(gated_delta_run)
    assert torch.equal(model.blocks[1].attn.A_log, parent_model.blocks[1].attn.A_log.mean(0, keepdim=True))
    prompts = [[5, 6, 7, 8], [9, 10]]
    assert lm.generate(model, prompts, 6) == lm.generate(model, prompts, 6, use_cache=False)


def test_a_gated_delta_checkpoint_uptrains_to_gqa(gated_delta_run, tmp_path):
    result = uptrain(uptrain_config(gated_delta_run, tmp_path, "attn.n_kv_head=2", "uptrain.steps=3",
                                    "uptrain.limit_val_batches=1"))
    assert result["steps"] == 3 and all(torch.isfinite(torch.tensor(loss)) for _, loss, *_ in result["val_history"])
    ckpt = read_checkpoint(result["last"])
    assert ckpt["lm"]["model_config"]["n_kv_head"] == 2
    model, _ = lm.load(result["last"])
    converted, _ = lm.load(gated_delta_run)
    assert model.blocks[0].attn.A_log.shape == (2,)
    # it trained: the weights moved from the conversion's
    mean, _ = to_grouped(converted.state_dict(), converted.config, 2)
    assert not torch.equal(model.blocks[0].attn.qkv.weight, mean["blocks.0.attn.qkv.weight"])
