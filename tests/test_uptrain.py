"""Uptraining through the Hydra configs: conversion only, a short uptrain, the study, bad targets."""

import hashlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_config

import lm
from lm.config.uptrain import UptrainRun
from lm.formats.checkpoint import read_checkpoint
from lm.studies.uptrain_ablation import run_study
from lm.training.uptraining import uptrain
from lm.util.errors import USER_ERRORS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def teacher(uptrain_teacher) -> Path:
    """A 4-head MHA run of 6 steps on the small corpus (conftest.py)."""
    return uptrain_teacher


def uptrain_config(teacher, tmp_path, *overrides, name="uptrain"):
    return compose_config(name, [f"ckpt={teacher}", f"checkpoint_dir={tmp_path}", "logger=none",
                                 "progress_bar=false", "sample_tokens=0", *overrides])


def test_conversion_only_writes_a_normal_checkpoint_with_provenance(teacher, tmp_path):
    cfg = uptrain_config(teacher, tmp_path, "attn.n_kv_head=1", "uptrain.init=first", "uptrain.steps=0",
                         f"out={tmp_path / 'mqa'}")
    result = uptrain(UptrainRun.from_config(cfg))
    model, tokenizer = lm.load(result["last"])
    assert model.config.n_kv_head == 1 and tokenizer.get_vocab_size() == 512
    provenance = read_checkpoint(result["last"])["lm"]["provenance"]
    assert provenance == {"source": str(teacher), "source_step": 6, "init": "first", "fraction": None, "steps": 0,
                          "n_kv_head_from": 4, "n_kv_head_to": 1, "target": "mqa", "distill": 0.0}
    assert (tmp_path / "mqa" / "tokenizer.json").is_file()
    assert len(lm.generate(model, [[1, 2, 3]], 5)[0]) == 8  # it decodes


def test_uptraining_runs_fraction_of_source_steps_and_records_the_conversion(teacher, tmp_path):
    cfg = uptrain_config(teacher, tmp_path, "attn.n_kv_head=2", "uptrain.fraction=0.5")
    result = uptrain(UptrainRun.from_config(cfg))
    assert result["steps"] == 3  # half of the teacher's 6 steps
    assert result["val_history"][0][0] == 0 and result["val_loss_before"] == result["val_history"][0][1]
    ckpt = read_checkpoint(result["last"])
    assert ckpt["lm"]["model_config"]["n_kv_head"] == 2
    assert ckpt["lm"]["provenance"]["init"] == "mean" and ckpt["lm"]["provenance"]["fraction"] == 0.5
    assert ckpt["lm"]["run_config"]["uptrain"]["source"] == str(teacher)
    assert ckpt["lm"]["tokenizer"] == read_checkpoint(teacher)["lm"]["tokenizer"]  # the source's tokenizer
    assert Path(result["run_dir"]).name == "teacher-gqa2-mean"


def test_study_writes_json_table_and_plot(teacher, tmp_path, capsys):
    overrides = [f"study.out={tmp_path / 'study'}", "study.decode_tokens=4", "uptrain.limit_val_batches=2"]
    cfg = uptrain_config(teacher, tmp_path, "study.kv_heads=[1]", "study.inits=[mean,random]",
                         "study.fractions=[0.5]", *overrides, name="uptrain_study")
    records = run_study(cfg)
    saved = json.loads((tmp_path / "study" / "results.json").read_text())["records"]
    assert [r["arm"] for r in saved] == ["teacher", "mqa-mean-0.5", "mqa-random-0.5", "mqa-scratch-0.5"]
    assert saved == records
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert [line[:5] for line in progress] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    teacher_record, arms = saved[0], saved[1:]
    assert teacher_record["steps"] == 6 and teacher_record["kv_heads"] == 4
    assert teacher_record["settings"]["source_sha256"] == hashlib.sha256(teacher.read_bytes()).hexdigest()
    for r in arms:
        assert r["steps"] == 3 and r["cache_bytes_per_token"] * 4 == teacher_record["cache_bytes_per_token"]
        # the first validation is the converted weights, the last the result
        assert r["history"][0][:2] == [0, r["val_loss_before"]] and r["history"][-1][:2] == [3, r["val_loss_after"]]
        assert "study" not in r["settings"] and r["settings"]["decode_tokens"] == 4
        assert "checkpoint_dir" not in r["settings"]  # where the study writes is not a setting of its figures
    for r in saved:  # every arm's decoding measured: a rate, not a missing or infinite figure
        assert 0 < r["decode_tokens_per_s"] < math.inf
    # right after conversion, mean-pooled heads keep more of the teacher than random ones
    assert saved[1]["val_loss_before"] < saved[2]["val_loss_before"]
    r = saved[1]
    assert (f"| mqa-mean-0.5 | 1 | mean | 0.50 | 3 | {r['val_loss_before']:.4f} | {r['val_loss_after']:.4f} | "
            f"{r['val_loss_after'] / teacher_record['val_loss_after'] - 1:+.1%} |") in \
        (tmp_path / "study" / "results.md").read_text()
    assert (tmp_path / "study" / "val_loss.png").read_bytes()[:4] == b"\x89PNG"

    # The study's folder moved elsewhere: its records still hold, nothing runs again.
    shutil.copytree(tmp_path / "study", tmp_path / "moved")
    moved = uptrain_config(teacher, tmp_path, "study.kv_heads=[1]", "study.inits=[mean,random]",
                           "study.fractions=[0.5]", f"study.out={tmp_path / 'moved'}", *overrides[1:],
                           name="uptrain_study")
    assert run_study(moved) == saved
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert all(line.endswith("(done before)") for line in progress) and len(progress) == 4

    # A longer grid reuses what it already holds. Mean-pooling groups of one head changes nothing, so the
    # training's validation of the converted weights scores exactly what the study's evaluator scored the teacher.
    more = uptrain_config(teacher, tmp_path, "study.kv_heads=[1,4]", "study.inits=[mean]", "study.fractions=[0.5]",
                          "study.scratch=false", *overrides, name="uptrain_study")
    again = run_study(more)
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert [line.endswith("(done before)") for line in progress] == [True, True, False]
    assert again[:2] == saved[:2] and again[2]["arm"] == "gqa4-mean-0.5"
    assert again[2]["val_loss_before"] == pytest.approx(teacher_record["val_loss_after"], rel=1e-5)


@pytest.mark.parametrize("override, message", [
    ("attn.n_kv_head=3", "error: n_head=4 is not divisible by n_kv_head=3"),
    ("uptrain.init=median", "error: uptrain.init='median' is not one of ['aligned', 'first', 'mean', 'random']"),
])
def test_an_invalid_target_is_one_line_before_anything_is_written(teacher, tmp_path, override, message):
    with pytest.raises(USER_ERRORS) as refused:
        uptrain(UptrainRun.from_config(uptrain_config(teacher, tmp_path, "attn.n_kv_head=2", override)))
    assert f"error: {refused.value}" == message  # the line scripts/uptrain.py prints
    assert not list(tmp_path.glob("**/*.ckpt"))


@pytest.mark.slow  # the script as its own process (Lightning's import alone: seconds); in process: test_command_fuzz
def test_the_script_says_a_bad_target_in_one_line_and_exits_2(teacher, tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "uptrain.py"), f"ckpt={teacher}",
                             "attn.n_kv_head=3", "logger=none", f"checkpoint_dir={tmp_path}",
                             f"hydra.run.dir={tmp_path / 'hydra'}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: n_head=4 is not divisible by n_kv_head=3"]
