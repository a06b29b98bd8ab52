"""scripts/compare.py: every kind on recall, language modelling and speed, resumable, checked up front."""

import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CONF_DIR
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from test_command_fuzz import run_in_process as run_script_in_process

import lm
from lm.attention import available_kinds
from lm.attention.base import spec_class
from lm.config.compare import CompareRun
from lm.model.config import ConfigError
from lm.training.run import model_config_of
from lm.util.errors import DataError

ROOT = Path(__file__).resolve().parents[1]


def run_compare(folder: Path, *overrides: str) -> subprocess.CompletedProcess:
    """scripts/compare.py run in `folder`, so Hydra's outputs/ (and any relative path) land there."""
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "compare.py"), *overrides],
                          capture_output=True, text=True, timeout=900, cwd=folder)


def planned(*overrides: str):
    from lm.studies.compare import plan

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return plan(CompareRun.from_config(compose(config_name="compare", overrides=list(overrides))))


def check_figures(r: dict, runs: Path | None = None, stopped_early: bool = False) -> None:
    """The figures of one record against the settings it holds and against each other, and a
    language-modelling record's parameters against the model its run left under `runs`."""
    s = r["settings"]
    if r["task"] == "speed":
        cap = s["speed"]["max_batch_tokens"] or math.inf
        rows = [(b, c) for b in s["speed"]["batches"] for c in s["speed"]["contexts"]]
        assert [(d["batch"], d["context"]) for d in r["decode"]] == [(b, c) for b, c in rows if b * c <= cap]
        assert r["decode_left_out"] == [[b, c] for b, c in rows if b * c > cap]
        for d in r["decode"]:  # measured: a rate and a prefill, the prefill timed within the arm
            assert 0 < d["tokens_per_s"] < math.inf and 0 < d["prefill_s"] < r["seconds"]
        assert [t["context"] for t in r["train"]] == s["speed"]["train_contexts"]
        for t in r["train"]:  # a training step of batch x context tokens, its time a part of the arm's
            assert t["batch"] == max(1, s["speed"]["train_tokens"] // t["context"])
            assert t["tokens_per_s"] == pytest.approx(t["batch"] * t["context"] / t["step_s"])
            assert 0 < t["step_s"] < r["seconds"]
        config = model_config_of(OmegaConf.create({"model": s["model"], "attn": s["attn"]}), s["vocab_size"])
        assert r["params"] == lm.Transformer(config).num_params()
        return
    assert s["run_name"] == r["arm"] and (r["steps"] <= s["trainer"]["max_steps"] if stopped_early
                                          else r["steps"] == s["trainer"]["max_steps"])
    assert (r["lr"], r["seed"]) == (s["optim"]["lr"], s["seed"])
    step, loss, accuracy, seconds = r["history"][-1]  # the last validation is the run's result
    assert (step, loss, accuracy, seconds) == (r["steps"], r["val_loss"], r["val_accuracy"], r["train_seconds"])
    sequence = s["data"]["seq_len"] if r["task"] == "mqar" else s["model"]["max_seq_len"]
    tokens_per_step = s["data"]["batch_size"] * sequence
    assert r["train_tokens_per_s"] * r["train_seconds"] == pytest.approx(r["steps"] * tokens_per_step)
    assert 0 < r["train_seconds"] < r["seconds"]  # the training is a part of the arm
    if r["task"] == "lm":
        assert r["bits_per_byte"] == pytest.approx(r["eval_loss"] * r["eval_tokens"] / math.log(2) / r["eval_bytes"])
        assert "checkpoint_dir" not in s  # where the study writes is not a setting its figures depend on
        model, _ = lm.load(runs / r["arm"] / "last.ckpt")
        assert r["params"] == model.num_params()


def full_cache_bytes(r: dict, context: int) -> int:
    """Keys and values of every K/V head in every layer, float32, for each position of the context."""
    model = r["settings"]["model"]
    n_kv_head = r["settings"]["attn"]["n_kv_head"] or model["n_head"]
    return 2 * model["n_layer"] * n_kv_head * (model["d_model"] // model["n_head"]) * context * 4


def run_in_process(*overrides: str) -> dict:
    from lm.studies.compare import run_study

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return run_study(CompareRun.from_config(compose(config_name="compare", overrides=list(overrides))))


def test_a_tiny_study_in_process_measures_reuses_and_reruns_what_a_setting_touches(tmp_path, small_corpus, capsys):
    corpus = tmp_path / "corpus"
    shutil.copytree(small_corpus, corpus)
    args = ["preset=quick", "kinds=[mqa]", "mqar.pairs=[2]", "mqar.steps=4", "mqar.val_every=4", "mqar.examples=64",
            "lm.steps=2", "lm.val_every=2", "data=text", f"data.paths=[{corpus}]", "data.vocab_size=512",
            f"data.cache_dir={tmp_path / 'cache'}", f"out={tmp_path / 'compare'}"]
    records = run_in_process(*args, "speed.contexts=[64,128]")["records"]
    assert [(r["arm"], r["task"], r["kind"]) for r in records] == [("mqar-mqa-d32-p2-lr0.003-s0", "mqar", "mqa"),
                                                                    ("lm-mqa-lr0.002-s0", "lm", "mqa"),
                                                                    ("speed-mqa", "speed", "mqa")]
    for r in records:
        check_figures(r, tmp_path / "compare" / "runs")
    mqa, speed = records[1], records[2]
    # the quick preset decodes batches of 1 and 2: twice the rows, twice the cache
    assert [d["cache_bytes"] for d in speed["decode"]] == [b * full_cache_bytes(speed, c) for b in (1, 2)
                                                           for c in (64, 128)]
    assert speed["params"] == mqa["params"]  # the speed arm measures the language-modelling shape
    out = tmp_path / "compare"
    assert json.loads((out / "results.json").read_text())["records"] == records
    table = (out / "results.md").read_text()
    row = f"| mqa | {mqa['params'] / 1e6:.2f}M | 0.002 | {mqa['eval_loss']:.4f} | {mqa['bits_per_byte']:.4f} |"
    assert row in table
    assert f"| mqa | {records[0]['val_accuracy']:.3f} |" in table
    assert (out / "mqar_accuracy.png").read_bytes()[:4] == b"\x89PNG" and (out / "lm_loss.png").is_file()
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert [line[:5] for line in progress] == ["[1/3]", "[2/3]", "[3/3]"]
    assert not any("done before" in x for x in progress)

    assert run_in_process(*args, "speed.contexts=[64,128]")["records"] == records  # nothing trained again
    again = run_in_process(*args, "speed.contexts=[64]")["records"]  # the decoding figures only: the speed arm reruns
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert [line.endswith("(done before)") for line in progress] == [True] * 5 + [False, False]
    assert progress[5] == "[3/3] speed-mqa: its settings changed (speed.contexts [64, 128] -> [64]); running it again"
    assert again[:2] == records[:2] and [d["context"] for d in again[2]["decode"]] == [64, 64]

    # The corpus's text rewritten under the same names: the language-modelling arm measures it afresh.
    first = sorted(corpus.iterdir())[0]
    first.write_text(first.read_text() + "\n# one more line\n")
    rerun = run_in_process(*args, "speed.contexts=[64]")["records"]
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert [line.endswith("(done before)") for line in progress] == [True, False, False, True]
    assert rerun[0] == records[0] and rerun[2] == again[2]
    assert progress[1].startswith("[2/3] lm-mqa-lr0.002-s0: its settings changed (corpus_fingerprint ")
    assert rerun[1]["settings"]["corpus_fingerprint"] != again[1]["settings"]["corpus_fingerprint"]


@pytest.mark.slow
def test_quick_preset_runs_every_kind_end_to_end_and_resumes(tmp_path, small_corpus):
    args = ["preset=quick", "data=text", f"data.paths=[{small_corpus}]", "data.vocab_size=512",
            f"data.cache_dir={tmp_path / 'cache'}", f"out={tmp_path / 'compare'}"]
    first = run_compare(tmp_path, *args)
    assert first.returncode == 0, first.stderr[-2000:]
    out = tmp_path / "compare"
    results = json.loads((out / "results.json").read_text())
    records = results["records"]
    kinds = {r["kind"] for r in records}
    # MHA, MQA, GQA and every other kind lm registers (the script's process does not import the
    # test-only kinds other test files register here), each with 2 recall runs, 1 language-modelling run
    # and 1 speed arm
    shipped = {k for k in available_kinds()
               if spec_class(k).__module__.startswith("lm.") and spec_class(k).compared_alone}
    assert kinds == {"mha", "mqa", "gqa"} | (shipped - {"softmax"})
    assert len(records) == 4 * len(kinds)
    progress = [line for line in first.stdout.splitlines() if line.startswith("[")]
    assert len(progress) == len(records) and not any("done before" in line for line in progress)
    for r in records:
        check_figures(r, out / "runs", stopped_early=True)
        assert json.loads((out / "records" / f"{r['arm']}.json").read_text()) == r
    by_kind = {r["kind"]: r for r in records if r["task"] == "lm"}
    cache = {r["kind"]: [d["cache_bytes"] for d in r["decode"]] for r in records if r["task"] == "speed"}
    speed_mha = next(r for r in records if r["arm"] == "speed-mha")
    # grows with the context and the batch
    assert cache["mha"] == [b * full_cache_bytes(speed_mha, c) for b in (1, 2) for c in (128, 256)]
    assert cache["linear"][1] == cache["linear"][0]  # a recurrent state does not
    assert cache["mqa"][0] * 2 == cache["gqa"][0] == cache["mha"][0]  # quick: 2 heads, so GQA (2 K/V heads) is MHA
    table = (out / "results.md").read_text()
    assert "### MQAR accuracy" in table and "### Language modelling" in table and "### Decoding speed" in table
    for kind, r in by_kind.items():
        row = f"| {kind} | {r['params'] / 1e6:.2f}M | 0.002 | {r['eval_loss']:.4f} | {r['bits_per_byte']:.4f} |"
        assert row in table
    assert (out / "mqar_accuracy.png").stat().st_size > 10_000 and (out / "lm_loss.png").stat().st_size > 10_000

    again = run_compare(tmp_path, *args)  # every run finished: nothing is trained again, the same figures come out
    assert again.returncode == 0, again.stderr[-2000:]
    progress = [line for line in again.stdout.splitlines() if line.startswith("[")]
    assert len(progress) == len(records) and all(line.endswith("(done before)") for line in progress)
    assert json.loads((out / "results.json").read_text())["records"] == records


@pytest.mark.slow
def test_a_changed_setting_reruns_only_the_runs_it_touches(tmp_path, small_corpus):
    args = ["preset=quick", "kinds=[mqa]", "data=text", f"data.paths=[{small_corpus}]", "data.vocab_size=512",
            f"data.cache_dir={tmp_path / 'cache'}", f"out={tmp_path / 'compare'}", "speed.contexts=[64]"]
    assert run_compare(tmp_path, *args).returncode == 0
    second = run_compare(tmp_path, *args, "mqar.pairs=[2,3]")
    assert second.returncode == 0, second.stderr[-2000:]
    progress = [line for line in second.stdout.splitlines() if line.startswith("[")]
    assert ["done before" in line for line in progress] == [True, False, True, True]  # p2, lm, speed kept; p3 new


def test_an_unknown_kind_is_one_line_before_any_work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where Hydra's outputs/ would land
    code, err = run_script_in_process("compare", ["preset=quick", "kinds=[mha,lineer]", f"out={tmp_path / 'compare'}"],
                                      monkeypatch)
    assert code == 2
    assert err.strip().splitlines() == [err.strip()]
    assert "kinds entry 'lineer' is neither an attn config" in err and "linear" in err
    assert not (tmp_path / "compare").exists()


@pytest.mark.parametrize(("overrides", "message"), [
    (["mqar.pairs=[4,20]"], "data.pairs=20 is more than the 15 distinct keys"),
    (["mqar.pairs=[4,16]", "mqar.seq_len=32", "mqar.vocab_size=256"], "data.pairs=16 does not fit data.seq_len=32"),
    (["mqar.widths=[30]"], "d_model=30"),
    (["kinds=[mha,mha]"], "kinds names \\['mha'\\] more than once"),
    (["kinds=[mqa]", "extra_kinds=[{name: x, attn: linear, feature_map: cosine}]"], "cosine"),
    (["extra_kinds=[5]"], "extra_kinds entry 5 must be a kind's name or {name: ..., attn: ..., option: ...}"),
    (["kinds={a: 1}"], "kinds={'a': 1} must be a list, e.g. kinds=\\[a,b\\]"),
    # the key the user typed, not the arm's internal one (trainer.max_steps, data.batch_size, optim.lr)
    (["lm.steps=0"], "^lm.steps=0 must be an integer >= 1$"),
    (["lm.batch_size=0"], "^lm.batch_size=0 must be an integer >= 1$"),
    (["lm.lr=-1"], "^lm.lr=-1 must be a positive number$"),
    (["mqar.examples=1.5"], "^mqar.examples=1.5 must be an integer >= 1$"),
    (["speed.new_tokens=2"], "^speed.new_tokens=2 must be an integer >= 3$"),
    (["speed.max_batch_tokens=0"], "^speed.max_batch_tokens=0 must be an integer >= 1$"),
    (["speed.compile=yes"], "^speed.compile='yes' must be true or false$"),
    (["speed.train_contexts=[64,0]"], "^speed.train_contexts entry=0 must be an integer >= 1$"),
    (["speed.train_tokens=-1"], "^speed.train_tokens=-1 must be an integer >= 1$"),
    (["++per_kind.mha={optim: {lr: 1}}"], "^per_kind.mha.optim is not a setting a kind may change"),
    (["++per_kind.mha={mqar: {widths: []}}"], "^per_kind.mha: mqar.widths=\\[\\] is empty"),
    (["++per_kind.mha=3"], "^per_kind.mha=3 must be a mapping"),
    (["speed.contexts=[]"], "speed.contexts=\\[\\] is empty"),
    (["mqar.widths=[]"], "mqar.widths=\\[\\] is empty"),
    (["lm.warmup_steps=-1"], "^lm.warmup_steps=-1 must be an integer >= 0$"),
    (["seed=-1"], "^seed=-1 must be an integer >= 0$"),
    (["extra_kinds=[{name: a/b, attn: mha}]"], "extra_kinds name 'a/b' must be a plain file name"),
    (["extra_kinds=[{name: .x, attn: mha}]"], "extra_kinds name '.x' must be a plain file name"),
    (["tasks=[]"], "tasks=\\[\\] is empty"),
    (["tasks=[mqar,recall]"], "^tasks entry='recall' is not one of \\['frontier', 'lm', 'mqar', 'speed'\\]$"),
    (["seeds=0"], "^seeds=0 must be an integer >= 1$"),
    (["mqar.lr=[]"], "mqar.lr=\\[\\] is empty"),
    (["mqar.lr=[0.01,-1]"], "^mqar.lr entry=-1 must be a positive number$"),
    (["mqar.lr=[0.01,0.01]"], "names a learning rate more than once"),
    (["lm.lr=0"], "^lm.lr=0 must be a positive number$"),
    (["mqar.stop_at_accuracy=2"], "^mqar.stop_at_accuracy=2 must be a number between 0 and 1$"),
    (["mqar.short_conv=-1"], "^mqar.short_conv=-1 must be an integer >= 0$"),
    (["mqar.filler=zeros"], "^mqar.filler='zeros' is not one of"),
    (["mqar.query_power=0"], "^mqar.query_power=0 must be in \\(0, 1\\]$"),
    (["speed.batches=[]"], "speed.batches=\\[\\] is empty"),
    (["speed.batches=[1,0]"], "^speed.batches entry=0 must be an integer >= 1$"),
    (["report_only=maybe"], "^report_only='maybe' must be true or false$"),
])
def test_bad_settings_are_refused_before_training(overrides, message):
    with pytest.raises(ConfigError, match=message):
        planned("preset=quick", *overrides)


def test_a_corpus_that_leaves_evaluation_no_text_is_refused_before_any_arm(tmp_path):
    (tmp_path / "only.py").write_text("x = 1\n")
    with pytest.raises(DataError, match="data.val_fraction=0.01 leaves no document of the corpus for validation"):
        planned("preset=quick", "data=text", f"data.paths=[{tmp_path}]", "data.val_fraction=0.01")


def test_plans_reuse_their_compositions_until_a_config_file_or_the_config_store_changes(tmp_path, monkeypatch):
    """lm.config.compose.composed: a second plan composes nothing again; an edited YAML (same size, so
    only its bytes tell), a schema stored since, or a file in a folder the primary config's own
    hydra.searchpath adds composes again, and the plan has the edit."""
    import hydra
    from hydra.core.config_store import ConfigStore

    from lm.studies.compare import plan

    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    composed = []
    monkeypatch.setattr(hydra, "compose", lambda **kw: composed.append(kw) or compose(**kw))

    def heads(*overrides) -> set:
        composed.clear()
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            arms = plan(CompareRun.from_config(compose(config_name="compare",
                                                      overrides=["preset=quick", "kinds=[mqa]", *overrides])))
        return {arm.settings["attn"]["n_kv_head"] for arm in arms if arm.labels["task"] != "speed"}

    assert heads() == {1} and composed
    assert heads() == {1} and not composed
    mqa = conf / "attn" / "mqa.yaml"
    mqa.write_text(mqa.read_text().replace("n_kv_head: 1", "n_kv_head: 2"))
    assert heads() == {2} and composed
    ConfigStore.instance().store(group="lm_test_later", name="late", node={"x": 1})
    try:
        assert heads() == {2} and composed
    finally:
        ConfigStore.instance().repo.pop("lm_test_later")
    # a folder that conf/train.yaml's own hydra.searchpath adds: its files are read too
    extra = tmp_path / "extra"
    (extra / "model").mkdir(parents=True)
    (conf / "model" / "tiny.yaml").rename(extra / "model" / "tiny.yaml")
    train = conf / "train.yaml"
    train.write_text(train.read_text().replace("searchpath: [pkg://lm.config]",
                                               f"searchpath: [pkg://lm.config, 'file://{extra}']"))
    assert heads() == {2} and composed
    assert heads() == {2} and not composed
    tiny = extra / "model" / "tiny.yaml"
    tiny.write_text(tiny.read_text().replace("n_head: 6", "n_head: 3"))
    assert heads() == {2} and composed


def test_registered_kinds_join_the_default_list_and_yaml_kinds_keep_their_config():
    arms = planned("preset=quick")
    mixers = {k for k in available_kinds() if k != "softmax" and spec_class(k).compared_alone}
    assert {arm.labels["kind"] for arm in arms} == {"mha", "mqa", "gqa"} | mixers and "baseconv" not in mixers
    lm_arms = {arm.labels["kind"]: arm.settings for arm in arms if arm.labels["task"] == "lm"}
    assert lm_arms["mqa"]["attn"]["n_kv_head"] == 1 and lm_arms["gqa"]["attn"]["n_kv_head"] == 2
    assert all(s["model"]["d_model"] == 32 for s in lm_arms.values())  # equal model size for every kind
    assert all(arm.settings["run_name"] == arm.name for arm in arms if arm.labels["task"] != "speed")
    # a speed arm's figures depend on the shape, the attention and `speed`, not on training
    speed = {arm.labels["kind"]: arm.settings for arm in arms if arm.labels["task"] == "speed"}
    assert set(speed) == set(lm_arms)
    assert all(set(s) == {"model", "attn", "vocab_size", "speed"} for s in speed.values())
    assert all(s["speed"] == {"contexts": [128, 256], "new_tokens": 8, "batches": [1, 2], "max_batch_tokens": None,
                              "compile": False, "train_contexts": [64], "train_tokens": 128, "train_steps": 1}
               for s in speed.values())
    assert speed["mqa"]["model"] == lm_arms["mqa"]["model"] and speed["mqa"]["attn"] == lm_arms["mqa"]["attn"]


def test_the_sweep_and_the_seeds_make_one_arm_per_cell_rate_and_seed():
    arms = planned("preset=quick", "kinds=[mha]", "mqar.pairs=[2]", "mqar.lr=[0.001,0.01]", "lm.lr=[0.002,0.004]",
                   "seed=5", "seeds=2", "mqar.examples=null")
    assert [arm.name for arm in arms] == [
        "mqar-mha-d32-p2-lr0.001-s5", "mqar-mha-d32-p2-lr0.001-s6", "mqar-mha-d32-p2-lr0.01-s5",
        "mqar-mha-d32-p2-lr0.01-s6", "lm-mha-lr0.002-s5", "lm-mha-lr0.002-s6", "lm-mha-lr0.004-s5",
        "lm-mha-lr0.004-s6", "speed-mha"]
    first = arms[0].settings
    assert (first["optim"]["lr"], first["seed"], first["data"]["seed"]) == (0.001, 5, 5)
    assert first["data"]["examples"] == 30 * 16  # null: fresh examples at every step
    assert (first["trainer"]["stop_at_accuracy"], first["model"]["short_conv"]) == (0.99, 2)
    assert [arm.labels["task"] for arm in planned("preset=quick", "kinds=[mha]", "tasks=[speed,mqar]")] == \
        ["mqar", "mqar", "speed"]


def test_a_kind_of_its_own_settings_runs_fewer_cells_and_the_report_names_them():
    overrides = ("preset=quick", "kinds=[mha,additive]", "mqar.widths=[32,64]",
                 "per_kind={additive: {seeds: 2, mqar: {widths: [32], pairs: [2]}, speed: {contexts: [128]}}, "
                 "gqa: {seeds: 3}}")  # a kind this run leaves out: its entry is kept, unused
    arms = planned(*overrides)
    names = [arm.name for arm in arms]
    assert [n for n in names if n.startswith("mqar-additive")] == ["mqar-additive-d32-p2-lr0.003-s0",
                                                                   "mqar-additive-d32-p2-lr0.003-s1"]
    assert len([n for n in names if n.startswith("mqar-mha")]) == 4  # 2 widths x 2 pairs: the others' grid stays
    speed = {arm.labels["kind"]: arm.settings["speed"]["contexts"] for arm in arms if arm.labels["task"] == "speed"}
    assert speed == {"mha": [128, 256], "additive": [128]}

    from lm.studies.report import recall_tables
    records = [{**arm.labels, "val_accuracy": 0.5, "steps": 30} for arm in arms if arm.labels["task"] == "mqar"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        settings = OmegaConf.to_container(compose(config_name="compare", overrides=list(overrides)))
    table = "\n".join(recall_tables(records, settings))
    assert "| additive | 0.500 ± 0.000 |  |  |  |" in table
    from lm.studies.report import mqar_plot
    figure = mqar_plot(records)  # additive has no line in the width-64 panel, but the legend names it
    assert [t.get_text() for t in figure.axes[-1].get_legend().get_texts()] == ["mha", "additive"]
    assert ("Settings of their own (per_kind; a blank cell was not run): additive: mqar.widths=[32], "
            "mqar.pairs=[2], seeds=2.") in table  # nokind is in no table: not named


def test_a_diverged_run_is_a_result_of_the_sweep_and_the_best_of_the_others_is_reported():
    from lm.studies.compare import unless_diverged
    from lm.studies.report import language_table, recall_tables
    from lm.util.errors import TrainingError

    def diverging(run_cfg):
        raise TrainingError("loss is nan at step 7; stopping with the last good checkpoint kept")

    assert unless_diverged(diverging, None) == {"diverged": "loss is nan at step 7; stopping with the last good "
                                                            "checkpoint kept"}
    with pytest.raises(ValueError, match="other errors"):  # only a non-finite loss is a result; the rest stop the study
        unless_diverged(lambda c: (_ for _ in ()).throw(ValueError("other errors")), None)

    def recall(lr, seed, **figures):
        return {"task": "mqar", "kind": "linear", "width": 64, "pairs": 4, "lr": lr, "seed": seed, **figures}

    records = [recall(0.01, 0, diverged="nan"), recall(0.01, 1, val_accuracy=0.9, steps=100),
               recall(0.003, 0, val_accuracy=0.6, steps=200), recall(0.003, 1, val_accuracy=0.5, steps=300),
               recall(0.03, 0, diverged="nan"), recall(0.03, 1, diverged="nan")]
    settings = {"mqar": {"vocab_size": 256, "n_layer": 2, "n_head": 4, "ff_mult": 3, "seq_len": 64, "steps": 300,
                         "batch_size": 64}}
    table = "\n".join(recall_tables(records, settings))
    # 0.01: 0.9 and a diverged seed (0) average 0.45, below 0.003's 0.55: the sweep's best is 0.003
    assert "| linear | 0.550 ± 0.071 |" in table
    assert "| linear | d64 / 4 | **0.550 (250)** | 0.900 (100), 1 of 2 diverged | diverged |" in table
    assert "a diverged run counts as 0 in the means above" in table

    lm_settings = {"lm": {"model": {"n_layer": 2, "d_model": 128, "n_head": 4, "d_ff": 384, "max_seq_len": 256},
                          "steps": 10, "batch_size": 4}}
    diverged_lm = [{"task": "lm", "kind": "linear", "lr": lr, "seed": 0, "diverged": "nan"} for lr in (0.01, 0.03)]
    assert "| linear | | | diverged at every learning rate | | |" in language_table(diverged_lm, lm_settings)


def test_a_kind_typed_without_brackets_is_one_kind_not_its_letters():
    arms = planned("preset=quick", "kinds=mha", "extra_kinds=linear")
    assert {arm.labels["kind"] for arm in arms} == {"mha", "linear"}


@pytest.mark.slow
def test_an_interrupted_study_continues_its_arm_from_its_checkpoint(tmp_path, small_corpus):
    from lm.formats.checkpoint import read_checkpoint

    out = tmp_path / "compare"
    args = ["preset=quick", "kinds=[mqa]", "mqar.pairs=[2]", "mqar.steps=3000", "mqar.val_every=500",
            "mqar.stop_at_accuracy=null", "data=text",
            f"data.paths=[{small_corpus}]", "data.vocab_size=512", f"data.cache_dir={tmp_path / 'cache'}",
            f"out={out}", "speed.contexts=[64]"]
    child = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "compare.py"), *args], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    last = out / "runs" / "mqar-mqa-d32-p2-lr0.003-s0" / "last.ckpt"
    deadline = time.time() + 300
    while not (last.is_file() and read_checkpoint(last)["global_step"] >= 500):  # the first validation saved it
        assert child.poll() is None and time.time() < deadline, "the study finished or stalled before step 500"
        time.sleep(0.05)
    child.send_signal(signal.SIGINT)
    _, stderr = child.communicate(timeout=300)
    assert child.returncode == 130, stderr
    stopped_at = read_checkpoint(last)["global_step"]
    assert 500 <= stopped_at < 3000
    assert stderr.strip().splitlines() == [
        f"[1/3] mqar-mqa-d32-p2-lr0.003-s0 stopped by SIGINT at step {stopped_at}; the arms before it are kept, "
        f"and the same command continues it from {last}"]

    again = run_compare(tmp_path, *args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"[1/3] mqar-mqa-d32-p2-lr0.003-s0: continuing from {last}, where it was interrupted" in again.stdout
    record = json.loads((out / "records" / "mqar-mqa-d32-p2-lr0.003-s0.json").read_text())
    check_figures(record)  # time, tokens and the validation history count the interrupted part too
    assert [h[0] for h in record["history"]] == list(range(500, 3001, 500))


@pytest.mark.slow
def test_arms_run_in_parallel_as_jobs_of_the_joblib_launcher_and_a_lost_one_alone_again(tmp_path):
    out = tmp_path / "compare"
    args = ["preset=quick", "kinds=[mqa]", "tasks=[mqar]", "mqar.pairs=[2,4]", "mqar.steps=4", "mqar.val_every=4",
            f"out={out}", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={tmp_path}/jobs"]
    first = run_compare(tmp_path, *args)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "running 2 of 2 arms as jobs of hydra/launcher=joblib" in first.stdout
    records = json.loads((out / "results.json").read_text())["records"]
    assert [r["arm"] for r in records] == ["mqar-mqa-d32-p2-lr0.003-s0", "mqar-mqa-d32-p4-lr0.003-s0"]
    for r in records:
        check_figures(r)
    # two worker processes of the launcher, neither of them the study's own
    workers = {r["ran_on"]["pid"] for r in records}
    assert len(workers) == 2
    progress = [line for line in first.stdout.splitlines() if line.startswith("[")]
    assert sum(line.endswith("(done before)") for line in progress) == 2  # the study gathered what the jobs wrote

    # An arm whose record is lost (a crashed job, a killed node) is launched again, and only it.
    (out / "records" / f"{records[1]['arm']}.json").unlink()
    again = run_compare(tmp_path, *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "running 1 of 2 arms as jobs of hydra/launcher=joblib" in again.stdout
    rerun = json.loads((out / "results.json").read_text())["records"]
    assert rerun[0] == records[0] and rerun[1]["ran_on"]["pid"] not in workers


def test_report_only_renders_the_finished_entries_and_runs_nothing(tmp_path, capsys):
    out = tmp_path / "compare"
    args = ["preset=quick", "tasks=[mqar]", "mqar.pairs=[2,4]", "mqar.steps=4", "mqar.val_every=4", f"out={out}"]
    records = run_in_process(*args, "kinds=[mqa]")["records"]
    capsys.readouterr()
    # linear has not run, and one of mqa's two cells has lost its record: only the other cell shows
    (out / "records" / f"{records[1]['arm']}.json").unlink()
    results = run_in_process(*args, "kinds=[mqa,linear]", "report_only=true")
    assert results["records"] == records[:1]
    assert results["unfinished"] == {"planned": 4, "arms": [records[1]["arm"], "mqar-linear-d32-p2-lr0.003-s0",
                                                            "mqar-linear-d32-p4-lr0.003-s0"]}
    assert sorted(p.name for p in (out / "records").iterdir()) == [f"{records[0]['arm']}.json"]  # nothing ran
    assert not (out / "runs" / "mqar-linear-d32-p2-lr0.003-s0").exists()
    table = (out / "results.md").read_text()
    assert "**Not finished:** 1 of 4 arms have run (rendered with report_only=true)" in table
    assert f"| mqa | {records[0]['val_accuracy']:.3f} |" in table and "| linear |" not in table
    assert "report_only: 1 of 4 arms have finished; 3 table entries wait for the other 3" in capsys.readouterr().out

    # Once every arm has finished, the report is the finished study's, with nothing said to be waiting.
    finished = run_in_process(*args, "kinds=[mqa]")
    capsys.readouterr()
    assert run_in_process(*args, "kinds=[mqa]", "report_only=true")["records"] == finished["records"]
    assert "report_only: all 2 arms have finished" in capsys.readouterr().out
    assert "unfinished" not in json.loads((out / "results.json").read_text())
    assert "Not finished" not in (out / "results.md").read_text()


def test_a_committed_report_continues_on_another_machine_through_records_from(tmp_path, capsys):
    args = ["preset=quick", "tasks=[mqar]", "mqar.steps=4", "mqar.val_every=4"]
    committed = run_in_process(*args, "kinds=[mqa]", f"out={tmp_path / 'there'}")
    # rendered before the study finished: seed 1 has not run, so both cells wait and show nothing,
    # but the report still holds their finished arms
    partial = run_in_process(*args, "kinds=[mqa]", "seeds=2", "report_only=true", f"out={tmp_path / 'there'}")
    assert partial["records"] == [] and partial["waiting"] == committed["records"]
    shutil.rmtree(tmp_path / "there" / "records")  # only results.json travels, as docs/compare does
    capsys.readouterr()
    source = tmp_path / "there" / "results.json"
    results = run_in_process(*args, "kinds=[mqa,linear]", f"out={tmp_path / 'here'}", f"records_from={source}")
    out = capsys.readouterr().out
    assert f"records_from={source}: 2 finished arms taken" in out
    progress = [line for line in out.splitlines() if line.startswith("[")]
    assert [line.endswith("(done before)") for line in progress] == [True, True, False, False]
    assert results["records"][:2] == committed["records"]  # mqa's two cells were not trained again
    assert [r["kind"] for r in results["records"][2:]] == ["linear", "linear"]
    assert not any((tmp_path / "here" / "runs" / r["arm"]).exists() for r in committed["records"])


def test_the_slurm_example_config_selects_the_submitit_launcher():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="compare", overrides=["+experiment=compare_on_slurm", "hydra.launcher.partition=p"],
                      return_hydra_config=True)
    assert cfg.hydra.runtime.choices["hydra/launcher"] == "submitit_slurm"
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher") and cfg.hydra.launcher.partition == "p"


def test_the_zoology_preset_plans_figure_2s_grid():
    arms = planned("preset=zoology", "kinds=[mha]", "extra_kinds=[]", "tasks=[mqar]")  # the grid of one kind
    cells = {(a.labels["width"], a.labels["pairs"], a.settings["data"]["seq_len"]) for a in arms}
    assert cells == {(w, p, 16 * p) for w in (64, 128, 256) for p in (4, 8, 16)}
    assert {a.labels["lr"] for a in arms} == {0.0001, 0.000464, 0.00215, 0.01}
    assert {a.labels["seed"] for a in arms} == {0, 1}
    data = arms[0].settings["data"]
    assert (data["vocab_size"], data["examples"], data["val_examples"]) == (8192, 100_000, 3000)
    assert all(a.settings["model"]["max_seq_len"] == a.settings["data"]["seq_len"] for a in arms)
    with pytest.raises(ConfigError, match=r"mqar.seq_len=\[64, 128\] must be one length, or one per entry"):
        planned("preset=zoology", "kinds=[mha]", "extra_kinds=[]", "tasks=[mqar]", "mqar.seq_len=[64,128]")


def test_the_zoology_preset_trains_its_longest_cell_end_to_end(tmp_path, capsys):
    """Figure 2's largest cell (16 pairs at length 256, vocabulary 8192) through the whole arm on a
    CPU, its examples, batch and steps cut to seconds: the preset's paths run, not only its plan."""
    out = tmp_path / "zoology"
    records = run_in_process("preset=zoology", "kinds=[mha]", "extra_kinds=[]", "tasks=[mqar]", "seeds=1",
                             "mqar.widths=[64]", "mqar.pairs=[16]", "mqar.seq_len=[256]", "mqar.lr=[0.01]",
                             "mqar.steps=3", "mqar.val_every=3", "mqar.warmup_steps=1", "mqar.batch_size=4",
                             "mqar.examples=1024", "mqar.val_examples=8", f"out={out}")["records"]
    assert [r["arm"] for r in records] == ["mqar-mha-d64-p16-lr0.01-s0"]
    record = records[0]
    check_figures(record)
    data = record["settings"]["data"]
    assert (data["vocab_size"], data["seq_len"], data["pairs"], data["examples"]) == (8192, 256, 16, 1024)
    assert record["settings"]["model"]["max_seq_len"] == 256 and 0 <= record["val_accuracy"] <= 1
    assert "| mha |" in (out / "results.md").read_text()
    assert [line[:5] for line in capsys.readouterr().out.splitlines() if line.startswith("[")] == ["[1/1]"]
