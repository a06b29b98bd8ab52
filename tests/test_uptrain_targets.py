"""Conversion targets and methods of scripts/uptrain.py beyond mean-pooling: MHA -> MLA (attn=mla),
aligned pooling (uptrain.init=aligned) and distillation (uptrain.distill), each from one command."""

from pathlib import Path

import pytest
import torch
from conftest import compose_config

import lm
from lm.attention.mla import LatentSpec
from lm.config.uptrain import UptrainRun
from lm.formats.checkpoint import read_checkpoint
from lm.training.uptraining import uptrain
from lm.util.errors import USER_ERRORS


def uptrain_config(teacher, tmp_path, *overrides):
    overrides = [f"ckpt={teacher}", f"checkpoint_dir={tmp_path}", "logger=none",
                 "progress_bar=false", "sample_tokens=0", *overrides]
    return UptrainRun.from_config(compose_config("uptrain", overrides))


def test_mla_conversion_writes_a_latent_model_whose_cache_decodes_exactly(uptrain_teacher, tmp_path):
    cfg = uptrain_config(uptrain_teacher, tmp_path, "attn=mla", "attn.kv_rank=24", "attn.rope_dim=4",
                         "uptrain.steps=0", f"out={tmp_path / 'mla'}")
    result = uptrain(cfg)
    model, _ = lm.load(result["last"])
    assert all(isinstance(spec, LatentSpec) and (spec.kv_rank, spec.rope_dim) == (24, 4) for spec in
               model.config.attention)
    assert all(len(spec.rope_pairs) == 2 for spec in model.config.attention)  # chosen per layer, 2 of 8 pairs
    provenance = read_checkpoint(result["last"])["lm"]["provenance"]
    assert provenance["target"] == "mla-r24-d4"
    assert provenance["rope_pairs"] == [list(spec.rope_pairs) for spec in model.config.attention]
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    cached = lm.generate(model, prompts, 12)  # the absorbed latent cache
    assert cached == lm.generate(model, prompts, 12, use_cache=False)  # against recomputation
    assert model.blocks[0].attn.generation_state().numel(100) == 100 * (24 + 4)  # the latent and the RoPE key


def test_mla_uptraining_with_distillation_reports_parent_and_converted_losses(uptrain_teacher, tmp_path, capsys):
    cfg = uptrain_config(uptrain_teacher, tmp_path, "attn=mla", "attn.kv_rank=24", "attn.rope_dim=4",
                         "uptrain.steps=2", "uptrain.distill=0.5", "uptrain.temperature=2.0")
    result = uptrain(cfg)
    assert result["steps"] == 2 and Path(result["run_dir"]).name == "teacher-mla-r24-d4-mean"
    # the parent scored on its own run's validation batches: the loss that run recorded at its last step
    teacher_history = read_checkpoint(uptrain_teacher)["lm"]["progress"]["val_history"]
    assert result["parent_val_loss"] == pytest.approx(teacher_history[-1][1], rel=1e-5)
    assert result["val_loss_before"] == result["val_history"][0][1]  # the converted weights, scored at step 0
    said = capsys.readouterr().out
    assert f"the parent's val loss {result['parent_val_loss']:.4f}" in said
    ckpt = read_checkpoint(result["last"])
    assert ckpt["lm"]["provenance"]["distill"] == 0.5
    assert ckpt["lm"]["run_config"]["attn"]["kind"] == "mla"
    assert not any(key.startswith("teacher") or "._teacher" in key for key in ckpt["state_dict"])


def test_aligned_pooling_converts_from_one_command(uptrain_teacher, tmp_path):
    cfg = uptrain_config(uptrain_teacher, tmp_path, "attn.n_kv_head=2", "uptrain.init=aligned", "uptrain.steps=0",
                         f"out={tmp_path / 'aligned'}")
    model, _ = lm.load(uptrain(cfg)["last"])
    mean, _ = lm.load(uptrain(uptrain_config(uptrain_teacher, tmp_path, "attn.n_kv_head=2", "uptrain.steps=0",
                                             f"out={tmp_path / 'mean'}"))["last"])
    assert model.config.n_kv_head == 2
    # the rotation changes the pooled K/V rows; the rest (MLP, embeddings) is the parent's
    assert not torch.equal(model.blocks[0].attn.qkv.weight, mean.blocks[0].attn.qkv.weight)
    assert torch.equal(model.embed.weight, mean.embed.weight)


@pytest.mark.parametrize("overrides, message", [
    (["attn=sliding"], "error: attn=sliding is not a conversion target; uptraining converts to softmax GQA/MQA"),
    (["attn=dsa"], "error: attn=dsa is not a conversion target: its lightning indexer has no counterpart"),
    (["attn=qwen3_next", "attn.n_kv_head=2"], "error: attn.pattern=['gated_delta', 'gated_delta', 'gated_delta', "
                                              "'softmax'] is not a conversion target: uptraining converts every"),
    (["attn=mla", "attn.last_kind=softmax"], "error: attn.last_kind=softmax is not a conversion target"),
    ([], "error: give the target: attn.n_kv_head=N (GQA; 1 is MQA) or attn=mla [attn.kv_rank=R]"),
    (["attn=mla", "attn.kv_rank=1000", "attn.rope_dim=4"],
     "error: attn.kv_rank=1000 is more than the rank the checkpoint's keys and values can have, "
     "min(d_model=64, n_head x (2 x 16 - rope_dim)) = 64"),
    (["attn=mla", "attn.rope_dim=3"], "error: rope_dim=3 must be even: RoPE rotates pairs of dimensions"),
    (["attn=mla", "attn.kv_rank=8", "attn.rope_dim=16"], "error: attn.rope_dim=16 must be less than the "
                                                         "checkpoint's head size 16"),
    (["attn.n_kv_head=2", "uptrain.distill=-1"], "error: uptrain.distill=-1 must be"),
])
def test_a_bad_target_or_method_is_one_line_before_anything_is_written(uptrain_teacher, tmp_path, overrides, message):
    """A user error, which scripts/uptrain.py prints as `error: <it>` with exit code 2 (tests/test_uptrain.py
    runs the script once)."""
    with pytest.raises(USER_ERRORS) as refused:
        uptrain(uptrain_config(uptrain_teacher, tmp_path, *overrides))
    line = f"error: {refused.value}"
    assert "\n" not in line and line.startswith(message), line
    assert not list(tmp_path.glob("**/*.ckpt"))  # nothing half-written


def test_the_methods_study_runs_each_target_at_equal_steps_and_reports_cache_bytes(uptrain_teacher, tmp_path):
    from lm.studies.uptrain_ablation import run_study

    mla = "{name: mla, kind: mla, kv_rank: 24, rope_dim: 4}"
    cfg = compose_config("uptrain_methods", [
        f"ckpt={uptrain_teacher}", f"checkpoint_dir={tmp_path}", "logger=none", f"study.out={tmp_path / 'study'}",
        "study.inits=[aligned]", "study.fractions=[0.5]", "study.scratch=false", "study.decode_tokens=4",
        "uptrain.limit_val_batches=2", f"study.methods=[{{name: mla-distill, attn: {mla}, distill: 0.5}}]"])
    records = run_study(cfg)
    assert [r["arm"] for r in records] == ["teacher", "gqa2-aligned-0.5", "mla-distill-0.5"]
    teacher, aligned, latent = records
    assert aligned["steps"] == latent["steps"] == 3  # the same budget
    assert (latent["kv_heads"], latent["init"], latent["target"]) == ("latent 24+4", "svd + distill", "mla-r24-d4")
    assert latent["cache_bytes_per_token"] == 2 * (24 + 4) * 4  # 2 layers of (latent + RoPE key), fp32
    assert aligned["cache_bytes_per_token"] * 2 == teacher["cache_bytes_per_token"]
    table = (tmp_path / "study" / "results.md").read_text()
    assert "| mla-distill-0.5 | latent 24+4 | svd + distill | 0.50 | 3 |" in table
    assert (tmp_path / "study" / "val_loss.png").read_bytes()[:4] == b"\x89PNG"


def test_a_methods_entry_without_a_target_is_one_line(uptrain_teacher, tmp_path):
    from lm.studies.uptrain_ablation import run_study
    from lm.util.errors import ConfigError

    cfg = compose_config("uptrain_methods", [f"ckpt={uptrain_teacher}", f"study.out={tmp_path / 'study'}",
                                             "study.methods=[{name: oops, init: mean}]"])
    with pytest.raises(ConfigError, match="study.methods entry .* must be a mapping with name and attn"):
        run_study(cfg)
