"""A study keeps its records until it is rerun on purpose: a setting added to the run config after
the records were written does not make them "of other settings" while the plan leaves it at the
value that does what they did (lm.studies.engine.ADDED_SINCE_RECORDS)."""

import json
from pathlib import Path

from hydra import compose, initialize_config_dir

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
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("train")
    for key, value in ADDED_SINCE_RECORDS.items():
        group, name = key.split(".")
        assert name in cfg[group], f"{key} is not a setting of conf/train.yaml"
        assert cfg[group][name] == value, f"{key}: its default is not the value records without it ran with"


def test_the_committed_comparisons_recall_arms_are_taken_by_todays_plan(tmp_path):
    """The recall arms of docs/compare/results.json (no corpus, no timing in their settings) continue
    under today's configs: their settings, with what was added since, are today's plan's."""
    from lm.studies import compare

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("compare", overrides=[f"out={tmp_path}", "tasks=[mqar]"])
        arms = compare.plan(cfg)
    results = json.loads((ROOT / "docs" / "compare" / "results.json").read_text())
    recall = [r for r in results["records"] if r["arm"].startswith("mqar-")]
    said = import_records(arms, tmp_path / "records", ROOT / "docs" / "compare" / "results.json")
    assert said.startswith(f"records_from={ROOT / 'docs' / 'compare' / 'results.json'}: {len(recall)} finished arms "
                           "taken"), said
    assert len(recall) > 200


def test_an_arm_takes_a_record_written_before_a_setting_was_added(tmp_path):
    """The same through a results file: the record's digest stays its own, its settings lack the new key."""
    from lm.studies.engine import sealed

    record = sealed({"arm": "a", "settings": RECORDED, "figures": {"accuracy": 0.5}})
    source = tmp_path / "results.json"
    source.write_text(json.dumps({"records": [record]}))
    planned = as_json_data({**RECORDED, "attn": {**RECORDED["attn"], "global_every": None}})
    arm = Arm(name="a", settings=planned, run=lambda resume: {})
    assert "1 finished arms taken" in import_records([arm], tmp_path / "records", source)
