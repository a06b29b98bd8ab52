"""A study keeps its records until it is rerun on purpose: a setting added to the run config after
the records were written does not make them "of other settings" while the plan leaves it at the
value that does what they did (lm.studies.engine.ADDED_SINCE_RECORDS)."""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from lm.config.compare import CompareRun
from lm.config.train import ADAMW_RECIPE
from lm.studies.engine import ADDED_SINCE_RECORDS, Arm, as_json_data, import_records, same_settings

ROOT = Path(__file__).resolve().parents[1]
RECORDED = {"attn": {"name": "mha", "kind": "softmax", "n_kv_head": 4}, "optim": {"lr": 0.003}, "seed": 0}


def test_a_setting_added_since_at_its_old_meaning_keeps_the_record():
    planned = {"attn": {**RECORDED["attn"], "global_every": None},
               "optim": {**RECORDED["optim"], "name": "adamw", "schedule": "cosine"}, "seed": 0}
    assert same_settings(RECORDED, planned)


def test_a_setting_added_since_at_another_value_or_an_unknown_one_runs_the_arm_again():
    assert not same_settings(RECORDED, {**RECORDED, "optim": {**RECORDED["optim"], "name": "muon"}})
    assert not same_settings(RECORDED, {**RECORDED, "optim": {**RECORDED["optim"], "schedule": "wsd"}})
    assert not same_settings(RECORDED, {**RECORDED, "never_declared": None})
    assert not same_settings(RECORDED, {**RECORDED, "seed": 1})  # a setting both hold, changed
    gone = {key: value for key, value in RECORDED.items() if key != "seed"}
    assert not same_settings(RECORDED, gone)  # a setting the plan no longer has


def test_every_added_setting_is_one_the_run_config_has():
    """In conf/train.yaml under the studies' recipe (ADAMW_RECIPE, which every arm composes). A kind's
    option is looked up in attn=hybrid, whose schema holds every kind's options; the recall data's in
    data=mqar."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        configs = [compose("train", overrides=[*ADAMW_RECIPE, *extra])
                   for extra in ([], ["data=mqar"], ["attn=hybrid"])]  # data.mix: mqar's; attn.*: every kind's
    for key, value in ADDED_SINCE_RECORDS.items():
        group, _, name = key.rpartition(".")
        nodes = [cfg[group] if group else cfg for cfg in configs]
        having = [node for node in nodes if name in node]
        assert having, f"{key} is not a setting of conf/train.yaml"
        assert all(node[name] == value for node in having), \
            f"{key}: its default is not the value records without it ran with"


@pytest.fixture(scope="module")
def default_recall_plan(tmp_path_factory):
    """The default study's recall arms as today's configs plan them (planning composes every kind: seconds)."""
    from lm.studies import compare

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compare.plan(CompareRun.from_config(compose("compare", overrides=[
            f"out={tmp_path_factory.mktemp('plan')}", "tasks=[mqar]"])))


def test_the_committed_frontier_pilot_arms_are_taken_by_todays_plan(tmp_path):
    """The finished arms of docs/compare-frontier/pilot-block/based/results.json continue under today's
    preset: the command that made them, with records_from=..., reruns none of them."""
    from lm.studies import compare

    source = ROOT / "docs" / "compare-frontier" / "pilot-block" / "based" / "results.json"
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        arms = compare.plan(CompareRun.from_config(compose("compare", overrides=[
            "preset=frontier", "kinds=[mha]", "extra_kinds=[]", "seeds=2", "frontier.knobs.mha=[{width: 64}]",
            "frontier.block=based", "frontier.n_layer=1", "frontier.lr=[0.003, 0.01]", "frontier.rates_at=grid",
            "frontier.schedule=cosine", f"out={tmp_path}"])))
    results = json.loads(source.read_text())
    finished = results["records"] + results.get("waiting", [])
    said = import_records(arms, tmp_path / "records", source)
    assert len(finished) == 4 and said.startswith(f"records_from={source}: 4 finished arms taken"), said


def test_an_arm_takes_a_record_written_before_a_setting_was_added(tmp_path):
    """The same through a results file: the record's digest stays its own, its settings lack the new key."""
    from lm.studies.engine import sealed

    record = sealed({"arm": "a", "settings": RECORDED, "figures": {"accuracy": 0.5}})
    source = tmp_path / "results.json"
    source.write_text(json.dumps({"records": [record]}))
    planned = as_json_data({**RECORDED, "attn": {**RECORDED["attn"], "global_every": None}})
    arm = Arm(name="a", settings=planned, run=lambda resume: {})
    assert "1 finished arms taken" in import_records([arm], tmp_path / "records", source)


# ------------------------------------------------------------- records are data, checked when read

GOOD = {"arm": "a", "kind": "mha", "steps": 100, "val_loss": 2.5, "val_accuracy": 0.25, "seconds": 3.0,
        "history": [[50, 3.0, 0.1, 1.5], [100, 2.5, 0.25, 3.0]], "train_tokens_per_s": None,
        "decode": [{"batch": 1, "context": 64, "tokens_per_s": 900.0}], "settings": RECORDED}
HOSTILE = [  # (the field rewritten, its value, how the line names it)
    ("val_accuracy", "high", "val_accuracy='high' is not a number"),
    ("val_accuracy", None, "val_accuracy=None is not a number"),
    ("val_accuracy", float("nan"), "val_accuracy=nan is not a finite number"),
    ("val_accuracy", -5, "val_accuracy=-5 is outside [0, 1]"),
    ("val_accuracy", 1e308, "val_accuracy=1e+308 is outside [0, 1]"),
    ("val_loss", float("inf"), "val_loss=inf is not a finite number"),
    ("val_loss", 1e308, "val_loss=1e+308 is outside [0, 10000]"),
    ("val_loss", -1.0, "val_loss=-1.0 is outside [0, 10000]"),
    ("val_loss", None, "val_loss=None is not a number"),
    ("val_loss", [1, 2], "val_loss=[1, 2] is not a number"),
    ("steps", -3, "steps=-3 is not a non-negative integer"),
    ("steps", 2.5, "steps=2.5 is not a non-negative integer"),
    ("steps", True, "steps=True is not a number"),
    ("steps", "100", "steps='100' is not a number"),
    ("seconds", -1.0, "seconds=-1.0 is negative"),
    ("history", [[10, float("nan"), 0.1, 1.0]], "history[0][1]=nan is not a finite number"),
    ("history", [[-10, 2.0, 0.1, 1.0]], "history[0][0]=-10 is not a non-negative integer"),
    ("history", [[10, 2.0, 7, 1.0]], "history[0][2]=7 is outside [0, 1]"),
    ("history", [5], "history[0]=5 is not [step, loss, ...]"),
    ("decode", [{"tokens_per_s": -900.0}], "decode[0].tokens_per_s=-900.0 is negative"),
    ("decode", [{"tokens_per_s": "fast"}], "decode[0].tokens_per_s='fast' is not a number"),
    ("settings", ["lr", 0.003], "settings=['lr', 0.003] is not a mapping"),
    ("kind", float("nan"), "kind=nan is not a finite number"),
]


def test_the_committed_records_are_all_good_data():
    """The checks' reference: every sealed record of the committed studies' results.json passes them
    (a benchmark's results.json, docs/serving/ or docs/recipe/, holds figures, not study records)."""
    from lm.studies.engine import is_sealed
    from lm.studies.records import bad_value

    studies = [json.loads(path.read_text()) for path in ROOT.glob("docs/**/results.json")]
    records = [r for study in studies if "benchmark" not in study for r in study["records"] if is_sealed(r)]
    assert len(records) > 400
    assert [(r["arm"], bad_value(r)) for r in records if bad_value(r) is not None] == []


@pytest.mark.parametrize("key, value, named", HOSTILE, ids=[f"{k}={v!r}" for k, v, _ in HOSTILE])
def test_a_record_of_bad_values_is_named_and_never_imported(tmp_path, key, value, named):
    from lm.studies.engine import sealed
    from lm.studies.records import bad_value

    assert bad_value(sealed(GOOD)) is None
    hostile = sealed({**GOOD, "arm": "b", key: value})  # its digest re-sealed: only its values can betray it
    source = tmp_path / "results.json"
    source.write_text(json.dumps({"records": [sealed(GOOD), hostile]}))
    arms = [Arm(name=name, settings=RECORDED, run=lambda resume=False: {}) for name in ("a", "b")]
    said = import_records(arms, tmp_path / "records", source)
    assert "\n" not in said and said.startswith(f"records_from={source}: 1 finished arms taken; left out: "
                                                "1 with values of no meaning; set aside: "), said
    assert named in said, said
    assert sorted(p.name for p in (tmp_path / "records").iterdir()) == ["a.json"]  # never copied


def test_a_study_folder_holding_a_bad_record_sets_it_aside_and_runs_the_arm_again(tmp_path, capsys):
    from lm.studies.engine import run_arms, sealed, write_record

    records = tmp_path / "records"
    records.mkdir()
    write_record(records / "b.json", {**GOOD, "arm": "b", "val_accuracy": float("nan")})
    write_record(records / "a.json", GOOD)
    ran = []

    def run(name):
        return lambda resume=False: ran.append(name) or {"steps": 100, "val_loss": 2.0, "val_accuracy": 0.5}

    arms = [Arm(name=name, settings=RECORDED, run=run(name)) for name in ("a", "b")]
    done = run_arms(arms, records, describe=lambda r: f"{r['arm']} {r['val_accuracy']}")
    assert ran == ["b"] and [r["arm"] for r in done] == ["a", "b"] and done[1]["val_accuracy"] == 0.5
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[1/2] a 0.25  (done before)"
    assert lines[1] == ("[2/2] b: its record b.json is set aside (val_accuracy=nan is not a finite number); "
                        "running it again")
    assert json.loads((records / "b.json").read_text()) == done[1] == sealed(done[1])


@pytest.mark.parametrize("task, data", [([], {"source": "pystdlib", "vocab_size": 8192}), (["data=mqar"], None)])
def test_a_studys_arm_trains_with_the_adamw_recipe_whatever_train_py_defaults_to(task, data):
    """compare.py and the frontier compose every arm with ADAMW_RECIPE under their own settings, so
    a change of scripts/train.py's defaults (model=nano, optim=muon) leaves their arms as recorded."""
    from lm.studies.compare_arms import Entry, training_config

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        default = compose("train")
        arm = training_config(Entry("mha", "mha", None, {}), task, {"seed": 0}, data)
    assert (default.model.name, default.optim.name) == ("nano", "muon")
    recipe = (arm.model.name, arm.optim.name, arm.optim.schedule, arm.trainer.max_steps)
    assert recipe == ("tiny", "adamw", "cosine", 500)
