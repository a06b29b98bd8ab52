"""scripts/compare.py: every kind on recall, language modelling and speed, resumable, checked up front."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CONF_DIR
from hydra import compose, initialize_config_dir

from lm.attention import available_kinds
from lm.attention.base import spec_class
from lm.model.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def run_compare(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "compare.py"), *overrides],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)


def planned(*overrides: str):
    from lm.studies.compare import plan

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return plan(compose(config_name="compare", overrides=list(overrides)))


def test_quick_preset_runs_every_kind_end_to_end_and_resumes(tmp_path, small_corpus):
    args = ["preset=quick", "data=text", f"data.paths=[{small_corpus}]", "data.vocab_size=512",
            f"data.cache_dir={tmp_path / 'cache'}", f"out={tmp_path / 'compare'}"]
    first = run_compare(*args)
    assert first.returncode == 0, first.stderr[-2000:]
    out = tmp_path / "compare"
    results = json.loads((out / "results.json").read_text())
    records = results["records"]
    kinds = {r["kind"] for r in records}
    # MHA, MQA, GQA and every other kind lm registers (the script's process does not import the
    # test-only kinds other test files register here), each with 2 recall runs and 1 language-modelling run
    shipped = {k for k in available_kinds() if spec_class(k).__module__.startswith("lm.")}
    assert kinds == {"mha", "mqa", "gqa"} | (shipped - {"softmax"})
    assert len(records) == 3 * len(kinds) and len(first.stdout.splitlines()) >= len(records)
    progress = [line for line in first.stdout.splitlines() if line.startswith("[")]
    assert len(progress) == len(records) and not any("done before" in line for line in progress)
    for r in records:
        assert 0 <= r["val_accuracy"] <= 1 and r["train_tokens_per_s"] > 0 and r["settings"]["run_name"] == r["arm"]
        if r["task"] == "lm":
            assert r["bits_per_byte"] > 0 and r["params"] > 0
            assert [d["context"] for d in r["decode"]] == [128, 256]
            assert all(d["tokens_per_s"] > 0 and d["cache_bytes"] > 0 for d in r["decode"])
    by_kind = {r["kind"]: r for r in records if r["task"] == "lm"}
    cache = {k: [d["cache_bytes"] for d in r["decode"]] for k, r in by_kind.items()}
    assert cache["mha"][1] == 2 * cache["mha"][0]  # a full cache grows with the context
    assert cache["linear"][1] == cache["linear"][0]  # a recurrent state does not
    assert cache["mqa"][0] * 2 == cache["gqa"][0] == cache["mha"][0]  # quick: 2 heads, so GQA (2 K/V heads) is MHA
    table = (out / "results.md").read_text()
    assert "### MQAR accuracy" in table and "### Language modelling, speed and memory" in table
    assert all(f"| {kind} |" in table for kind in kinds)
    assert (out / "mqar_accuracy.png").stat().st_size > 10_000 and (out / "lm_loss.png").stat().st_size > 10_000

    again = run_compare(*args)  # every run finished: nothing is trained again, the same figures come out
    assert again.returncode == 0, again.stderr[-2000:]
    progress = [line for line in again.stdout.splitlines() if line.startswith("[")]
    assert len(progress) == len(records) and all(line.endswith("(done before)") for line in progress)
    assert json.loads((out / "results.json").read_text())["records"] == records


def test_a_changed_setting_reruns_only_the_runs_it_touches(tmp_path, small_corpus):
    args = ["preset=quick", "kinds=[mqa]", "data=text", f"data.paths=[{small_corpus}]", "data.vocab_size=512",
            f"data.cache_dir={tmp_path / 'cache'}", f"out={tmp_path / 'compare'}", "speed.contexts=[64]"]
    assert run_compare(*args).returncode == 0
    second = run_compare(*args, "mqar.pairs=[2,3]")
    assert second.returncode == 0, second.stderr[-2000:]
    progress = [line for line in second.stdout.splitlines() if line.startswith("[")]
    assert ["done before" in line for line in progress] == [True, False, True]  # p2 and lm kept, p3 new


def test_an_unknown_kind_is_one_line_before_any_work(tmp_path):
    run = run_compare("preset=quick", "kinds=[mha,lineer]", f"out={tmp_path / 'compare'}")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [run.stderr.strip()]
    assert "kinds entry 'lineer' is neither an attn config" in run.stderr and "linear" in run.stderr
    assert not (tmp_path / "compare").exists()


@pytest.mark.parametrize(("overrides", "message"), [
    (["mqar.pairs=[4,20]"], "data.pairs=20 is more than the 15 distinct keys"),
    (["mqar.pairs=[4,16]", "mqar.seq_len=32", "mqar.vocab_size=256"], "data.pairs=16 does not fit data.seq_len=32"),
    (["mqar.widths=[30]"], "d_model=30"),
    (["kinds=[mha,mha]"], "kinds names \\['mha'\\] more than once"),
    (["extra_kinds=[{name: x, attn: linear, feature_map: cosine}]"], "cosine"),
])
def test_bad_settings_are_refused_before_training(overrides, message):
    with pytest.raises(ConfigError, match=message):
        planned("preset=quick", *overrides)


def test_registered_kinds_join_the_default_list_and_yaml_kinds_keep_their_config():
    arms = planned("preset=quick")
    by_name = {arm.entry.name: arm.entry for arm in arms}
    assert set(by_name) == {"mha", "mqa", "gqa"} | (set(available_kinds()) - {"softmax"})
    lm_arms = {arm.entry.name: arm for arm in arms if arm.task == "lm"}
    assert lm_arms["mqa"].cfg.attn.n_kv_head == 1 and lm_arms["gqa"].cfg.attn.n_kv_head == 2
    assert all(arm.cfg.model.d_model == 32 for arm in lm_arms.values())  # equal model size for every kind
