"""preset=frontier (lm/studies/frontier.py, frontier_report.py): recall against the bytes each kind's
own generation cache holds, its Pareto front, the points the step budget stopped, and resuming."""

import json
from pathlib import Path

import pytest
import torch
from conftest import CONF_DIR
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import lm
from lm.config.compare import CompareRun
from lm.model.config import ConfigError
from lm.model.generation_cache import GenerationCache
from lm.studies.frontier_report import on_plateau, pareto_front, state_points, still_learning
from lm.training.settings import model_config_of

# Every path of the frontier at toy sizes: three kinds, two state sizes each, one seed, seconds.
TOY = ["preset=frontier", "kinds=[mha,linear,sliding]", "extra_kinds=[]", "per_kind=null", "seeds=1",
       "frontier.train=[[16,2],[32,4]]", "frontier.test=[[16,2],[32,4],[64,4]]", "frontier.vocab_size=32",
       "frontier.width=16", "frontier.n_head=2", "frontier.knobs.mha=[{width: 16}, {width: 32}]",
       "frontier.knobs.linear=[{n_head: 4}, {n_head: 2}]", "frontier.knobs.sliding=[{window: 4}, {window: 8}]",
       "frontier.steps=6", "frontier.val_every=3", "frontier.batch_size=8", "frontier.examples=64",
       "frontier.val_examples=16", "frontier.test_examples=16", "frontier.lr=[0.01]", "frontier.warmup_steps=1",
       "frontier.rates_at=grid"]


def run_in_process(*overrides: str) -> dict:
    from lm.studies.compare import run_study

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return run_study(CompareRun.from_config(compose(config_name="compare", overrides=list(overrides))))


def planned(*overrides: str):
    from lm.studies.compare import plan

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return plan(CompareRun.from_config(compose(config_name="compare", overrides=list(overrides))))


@pytest.fixture(scope="module")
def toy_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("frontier") / "study"
    return out, run_in_process(*TOY, f"out={out}")


def declared_bytes(model, seq_len: int) -> int:
    """What the layers declare they keep after seq_len tokens (their CacheSpec, float32), plus the
    short convolutions' caches: an account apart from the built cache the study asks."""
    specs = sum(block.attn.generation_state().numel(seq_len) * 4 for block in model.blocks)
    context = GenerationCache(model, pad=torch.zeros(1, dtype=torch.long), max_len=seq_len)
    convs = sum(sum(t.numel() * t.element_size() for t in c.tensors().values()) for c in context.short_convs if c)
    return specs + convs


def test_each_records_state_bytes_are_its_own_caches_at_each_test_length(toy_study):
    out, results = toy_study
    records = [r for r in results["records"] if r["task"] == "frontier"]
    assert {r["kind"] for r in records} == {"mha", "linear", "sliding"} and len(records) == 6
    for r in records:
        model, _ = lm.load(out / "runs" / r["arm"] / "last.ckpt")
        assert [(t["seq_len"], t["pairs"]) for t in r["tests"]] == [(16, 2), (32, 4), (64, 4)]
        for t in r["tests"]:
            built = GenerationCache(model, pad=torch.zeros(1, dtype=torch.long), max_len=t["seq_len"]).nbytes()
            assert t["state_bytes"] == built == declared_bytes(model, t["seq_len"])
            assert 0 <= t["accuracy"] <= 1
    by_length = {r["arm"]: [t["state_bytes"] for t in r["tests"]] for r in records}
    for arm, (b16, b32, b64) in by_length.items():
        if "-mha-" in arm:  # K/V of every position: grows by the same bytes per token
            assert b16 < b32 < b64 and b64 - b32 == 2 * (b32 - b16)
        else:  # a recurrent state, a ring the window fills: the same at every length past the window
            assert b32 == b64
    widths = [by_length[f"frontier-mha-width{w}-lr0.01-s0"][0] for w in (16, 32)]
    assert widths[1] > widths[0]  # the knob moves the state


def test_the_report_draws_the_frontier_and_tables_every_test_cell(toy_study):
    out, results = toy_study
    table = (out / "results.md").read_text()
    assert "### Recall against decoding-state size" in table
    for seq_len, pairs in ((16, 2), (32, 4), (64, 4)):
        assert f"#### Sequence {seq_len}, {pairs} pairs" in table
    assert table.count("**front**") >= 3  # each panel has a front
    assert (out / "frontier.png").stat().st_size > 10_000
    assert not (out / "mqar_accuracy.png").exists()  # no recall grid ran
    assert json.loads((out / "results.json").read_text())["records"] == results["records"]


def test_a_finished_arm_is_not_run_again(toy_study, capsys):
    out, results = toy_study
    again = run_in_process(*TOY, f"out={out}")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert len(lines) == 6 and all(line.endswith("(done before)") for line in lines)
    assert again["records"] == results["records"]
    # a changed test reruns the arms it touches, here every one, naming why
    changed = planned(*TOY, f"out={out}", "frontier.test=[[16,2],[64,4]]")
    from lm.studies.engine import stored_record

    assert all(stored_record(out / "records" / f"{a.name}.json", a.settings).state == "changed" for a in changed)


def test_the_pareto_front_of_a_hand_worked_example():
    points = [(100, 0.5), (200, 0.4), (200, 0.9), (50, 0.1), (400, 0.9), (800, 1.0)]
    # (200, 0.4) is beaten by (100, 0.5): fewer bytes, higher accuracy; (400, 0.9) by (200, 0.9): equal accuracy,
    # fewer bytes; the others each hold the best accuracy at their bytes
    assert pareto_front(points) == [3, 0, 2, 5]
    assert pareto_front([(10, 0.5), (10, 0.5)]) == [0, 1]  # equal points do not beat each other
    assert pareto_front([(10, 0.5), (10, 0.7)]) == [1]


def record(kind, point, lr, seed, mix, history, steps=100, max_steps=100, tests=((64, 4, 0.5, 1000),)):
    return {"task": "frontier", "kind": kind, "point": point, "lr": lr, "seed": seed, "val_accuracy": mix,
            "steps": steps, "history": history, "settings": {"trainer": {"max_steps": max_steps}},
            "tests": [{"seq_len": s, "pairs": p, "accuracy": a, "state_bytes": b} for s, p, a, b in tests]}


def test_a_point_takes_its_best_rate_on_the_mix_and_is_marked_when_the_budget_stopped_it():
    rising = [[50, 2.0, 0.40, 1.0], [100, 1.5, 0.60, 2.0]]  # +0.2 at the last validation
    flat = [[50, 2.0, 0.60, 1.0], [100, 1.9, 0.605, 2.0]]
    records = [record("linear", "n_head=4", 0.01, 0, 0.6, rising, tests=((64, 4, 0.30, 1000),)),
               record("linear", "n_head=4", 0.01, 1, 0.6, flat, tests=((64, 4, 0.50, 1000),)),
               record("linear", "n_head=4", 0.03, 0, 0.2, flat, tests=((64, 4, 0.90, 1000),)),
               record("linear", "n_head=4", 0.03, 1, 0.2, flat, tests=((64, 4, 0.90, 1000),)),
               {"task": "frontier", "kind": "mha", "point": "width=32", "lr": 0.01, "seed": 0, "diverged": "nan"},
               record("mha", "width=32", 0.03, 0, 0.9, flat, steps=60, tests=((64, 4, 0.95, 8000),))]
    linear, mha = state_points(records, threshold=0.01, plateau=0.05)
    # the rate is chosen on the mix (0.6 > 0.2), not on a test, so one model answers every test
    assert (linear.lr, linear.seeds, linear.budget_stopped, linear.on_plateau) == (0.01, 2, True, False)
    assert linear.accuracy[(64, 4)] == pytest.approx((0.4, 0.1414), abs=1e-4)
    assert linear.state_bytes == {(64, 4): 1000}
    assert not state_points(records, threshold=0.5, plateau=0.05)[0].budget_stopped  # a rise of 0.2 is within 0.5
    assert (mha.lr, mha.budget_stopped, mha.on_plateau, mha.state_bytes) == (0.03, False, False, {(64, 4): 8000})
    assert not still_learning(records[-1], 0.0)  # stopped early at 0.99: converged, whatever the last rise


def test_a_point_is_a_measured_limit_only_with_its_rate_bracketed():
    from lm.studies.frontier_report import frontier_plot, measured_limit

    flat = [[50, 2.0, 0.80, 1.0], [100, 1.9, 0.80, 2.0]]
    inside = [record("mha", "width=32", lr, 0, mix, flat) for lr, mix in ((0.001, 0.3), (0.00316, 0.8), (0.01, 0.5))]
    edge = [record("mha", "width=64", lr, 0, mix, flat) for lr, mix in ((0.001, 0.3), (0.00316, 0.5), (0.01, 0.8))]
    narrow, wide = state_points(inside + edge, threshold=0.01, plateau=0.05)
    assert (narrow.lr, narrow.bracketed, measured_limit(narrow)) == (0.00316, True, True)
    assert (wide.lr, wide.bracketed, measured_limit(wide)) == (0.01, False, False)  # 0.0316 might do better
    for r in inside + edge:
        r["settings"]["data"] = {"vocab_size": 512}
    figure = frontier_plot(inside + edge, 0.01, 0.05)
    test, summary = figure.axes[:2]
    assert summary.get_title() == "mean of the 1 tests (bytes at 64)"
    grey = sorted(line.get_ydata()[0] for line in test.get_lines() if line.get_color() == "grey")
    assert grey == [pytest.approx(1 / 256), pytest.approx(1 / 4)]  # chance among 256 values; one of 4 pairs'


def test_a_point_that_ran_every_step_near_chance_is_marked_on_the_plateau():
    """MQAR is learnt in a jump: a run that ends on the flat stretch before it (no rise at its last
    validation, so not *budget*) has not shown the kind's limit either."""
    flat_at_chance = [[50, 5.3, 0.010, 1.0], [100, 5.3, 0.012, 2.0]]
    stuck = record("gated_delta", "n_head=8", 0.01, 0, 0.012, flat_at_chance)
    point, = state_points([stuck], threshold=0.01, plateau=0.05)
    assert (point.budget_stopped, point.on_plateau) == (False, True)
    assert not on_plateau(stuck, 0.01)  # 0.012 is above a plateau bound of 0.01
    # an arm that stopped before its last step (at 0.99, or interrupted) is not said to be on the plateau
    assert not on_plateau(record("mha", "width=32", 0.01, 0, 0.012, flat_at_chance, steps=60), 0.05)


SEARCH = [*TOY, "kinds=[mha]", "frontier.knobs.mha=[{width: 16}, {width: 24}, {width: 32}]", "seeds=2",
          "frontier.lr=[0.001, 0.00316, 0.01, 0.0316]", "frontier.rates_at=middle"]


def finish(out: Path, arms, mix: dict[tuple[str, float], float]) -> None:
    """Records, as the engine seals them, for the planned arms `mix` names by (point, rate): their
    accuracy on the mix."""
    from lm.studies.engine import as_json_data, write_record

    for a in arms:
        accuracy = mix.get((a.labels["point"], a.labels["lr"]))
        if accuracy is not None and a.labels["seed"] == 0:
            write_record(out / "records" / f"{a.name}.json", as_json_data({
                "arm": a.name, **a.labels, "steps": 6, "val_loss": 1.0, "val_accuracy": accuracy,
                "train_seconds": 1.0, "train_tokens_per_s": 1.0, "history": [[6, 1.0, accuracy, 1.0]], "tests": [],
                "seconds": 1.0, "settings": a.settings}))


def plan_of(arms) -> set[tuple[str, float, int]]:
    return {(a.labels["point"], a.labels["lr"], a.labels["seed"]) for a in arms}


def test_the_rate_search_runs_the_grid_at_the_middle_size_then_its_best_and_neighbours_at_the_others(tmp_path):
    out = tmp_path / "study"
    grid = [0.001, 0.00316, 0.01, 0.0316]
    arms = planned(*SEARCH, f"out={out}")
    assert plan_of(arms) == {("width=24", lr, 0) for lr in grid}  # the others wait for the middle's records
    finish(out, arms, {("width=24", 0.001): 0.2, ("width=24", 0.00316): 0.9, ("width=24", 0.01): 0.5,
                       ("width=24", 0.0316): 0.1})
    arms = planned(*SEARCH, f"out={out}")
    assert plan_of(arms) == ({("width=24", lr, 0) for lr in grid} | {("width=24", 0.00316, 1)}
                             | {(p, lr, 0) for p in ("width=16", "width=32") for lr in (0.001, 0.00316, 0.01)})
    # a best rate at an edge of the rates a point ran goes one step further that way, past the grid too
    finish(out, arms, {("width=16", 0.001): 0.6, ("width=16", 0.00316): 0.4, ("width=16", 0.01): 0.3,
                       ("width=32", 0.001): 0.3, ("width=32", 0.00316): 0.8, ("width=32", 0.01): 0.7})
    arms = planned(*SEARCH, f"out={out}")
    assert {t for t in plan_of(arms) if t[0] == "width=16"} == {("width=16", lr, 0) for lr in (0.00032, *grid[:3])}
    assert {t for t in plan_of(arms) if t[0] == "width=32"} == (
        {("width=32", lr, 0) for lr in grid[:3]} | {("width=32", 0.00316, 1)})
    finish(out, arms, {("width=16", 0.00032): 0.7})
    assert ("width=16", 0.00032, 1) in plan_of(planned(*SEARCH, f"out={out}"))


def test_a_search_whose_best_rate_stayed_on_the_plateau_goes_no_further(tmp_path):
    out = tmp_path / "study"
    arms = planned(*SEARCH, f"out={out}")
    finish(out, arms, {("width=24", 0.001): 0.01, ("width=24", 0.00316): 0.012, ("width=24", 0.01): 0.015,
                       ("width=24", 0.0316): 0.02})  # all at chance: their best is noise, not a direction
    arms = planned(*SEARCH, f"out={out}")
    assert {t for t in plan_of(arms) if t[0] == "width=24"} == (
        {("width=24", lr, 0) for lr in (0.001, 0.00316, 0.01, 0.0316)} | {("width=24", 0.0316, 1)})
    assert {t for t in plan_of(arms) if t[0] == "width=16"} == {("width=16", lr, 0) for lr in (0.01, 0.0316, 0.1)}


@pytest.mark.parametrize(("first", "then", "val_every"), [(4, 10, 2), (8, 12, 4)])  # mid-epoch; the epoch's end
def test_an_arm_continued_under_a_raised_cap_is_the_run_that_had_the_higher_cap_from_the_start(
        first, then, val_every, tmp_path, capsys):
    """The naive twin of a continuation: one arm run to `first` steps (of an 8-batch epoch), its cap
    then raised, against the same arm run to the higher cap at once (a constant rate after warm-up,
    the same examples): equal curves, tests and weights."""
    one = [*TOY, "kinds=[mha]", "frontier.knobs.mha=[{width: 16}]", "frontier.stop_at_accuracy=null",
           f"frontier.val_every={val_every}"]
    staged, straight = tmp_path / "staged", tmp_path / "straight"
    first_record = run_in_process(*one, f"frontier.steps={first}", f"out={staged}")["records"][0]
    assert first_record["steps"] == first
    continued = run_in_process(*one, f"frontier.steps={then}", f"out={staged}")["records"][0]
    assert f"it ran to its cap, raised (trainer.max_steps {first} -> {then})" in capsys.readouterr().out
    whole = run_in_process(*one, f"frontier.steps={then}", f"out={straight}")["records"][0]
    assert continued["steps"] == whole["steps"] == then
    assert [row[:3] for row in continued["history"]] == [row[:3] for row in whole["history"]]
    assert continued["tests"] == whole["tests"] and continued["val_loss"] == whole["val_loss"]
    name = first_record["arm"]
    weights = [torch.load(out / "runs" / name / "last.ckpt", weights_only=True)["state_dict"]
               for out in (staged, straight)]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_the_default_frontier_trains_on_based_s_counts_per_cell(tmp_path):
    arms = planned("tasks=[frontier]", "kinds=[mha]", "extra_kinds=[]", f"out={tmp_path}")
    data = arms[0].settings["data"]
    assert data["mix"] == [[64, 4], [128, 8], [256, 16], [256, 32], [256, 64]]
    assert data["mix_examples"] == [100000, 20000, 20000, 20000, 20000] and data["examples"] == 180000


def test_a_search_whose_every_rate_diverged_goes_one_step_lower(tmp_path):
    from lm.studies.engine import as_json_data, write_record

    out = tmp_path / "study"
    for a in planned(*SEARCH, f"out={out}"):
        write_record(out / "records" / f"{a.name}.json", as_json_data({"arm": a.name, **a.labels, "diverged": "nan",
                                                                       "seconds": 1.0, "settings": a.settings}))
    plan = plan_of(planned(*SEARCH, f"out={out}"))
    assert ("width=24", 0.00032, 0) in plan and not any(t[0] != "width=24" for t in plan)  # the rest waits for it


def test_an_arm_that_passed_its_stop_at_the_cap_did_not_run_to_it():
    from lm.studies.frontier_report import ran_every_step

    at_cap = {"steps": 1500, "val_accuracy": 0.995, "settings": {"trainer": {"max_steps": 1500,
                                                                             "stop_at_accuracy": 0.99}}}
    assert not ran_every_step(at_cap)  # it stopped for its accuracy: a higher cap would have stopped it there too
    assert ran_every_step({**at_cap, "val_accuracy": 0.5})


def test_the_rate_ladder_steps_along_the_grid_then_by_its_ratio_beyond_it():
    from lm.studies.frontier import RateLadder

    ladder = RateLadder([0.01, 0.001, 0.0316, 0.00316])
    assert ladder.grid == [0.001, 0.00316, 0.01, 0.0316] and ladder.ratio == pytest.approx(10 ** 0.5, rel=1e-3)
    assert (ladder.step(0.00316, 1), ladder.step(0.00316, -1)) == (0.01, 0.001)
    assert (ladder.step(0.0316, 1), ladder.step(0.001, -1), ladder.step(0.1, 1)) == (0.1, 0.00032, 0.32)
    assert ladder.around(0.0316) == [0.01, 0.0316, 0.1]
    assert ladder.around(0.1) == [0.0316, 0.1, 0.32]  # back onto the grid, not 0.032
    assert RateLadder([0.01]).around(0.01) == [0.01]  # one rate: nothing to step by


def test_the_preset_plans_the_rate_grid_at_each_kinds_middle_state_size_first():
    from lm.attention import available_kinds
    from lm.studies.frontier import knob_points, point_label

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="compare", overrides=["preset=frontier"])
    arms = planned("preset=frontier")
    kinds = {a.labels["kind"] for a in arms}
    assert {"mha", "mqa", "gqa", "based", "linear-taylor", "hybrid-gated_delta", "hybrid-linear",
            "hybrid-sliding"} <= kinds
    mixers = {k for k in available_kinds() if k != "softmax" and lm.attention.spec_class(k).compared_alone}
    assert mixers <= kinds and "baseconv" not in kinds  # every registered mixer, a later one by its width
    for kind in kinds:
        own = [a for a in arms if a.labels["kind"] == kind]
        points = knob_points(cfg.frontier, kind)
        assert 3 <= len(points) <= 5, kind  # several state sizes, of which no record yet: the middle one alone
        assert {a.labels["point"] for a in own} == {point_label(points[len(points) // 2])}, kind
        assert {a.labels["seed"] for a in own} == {0}, kind
        one_rate = kind == "additive"  # per_kind: the kind whose CPU step costs 10-20x MHA's
        assert {a.labels["lr"] for a in own} == ({0.01} if one_rate else {0.001, 0.00316, 0.01, 0.0316}), kind
        assert {a.settings["trainer"]["max_steps"] for a in own} == {1500}, kind
        assert {a.settings["optim"]["schedule"] for a in own} == {"constant"}, kind
        assert {a.settings["data"]["examples"] for a in own} == {48000}, kind  # the same examples under any cap
        assert {a.settings["data"]["mix_examples"] for a in own} == {None}, kind  # shared equally
    data = arms[0].settings["data"]
    assert data["mix"] == [[64, 4], [128, 8], [256, 16], [256, 32], [256, 64]]
    assert arms[0].settings["tests"][-1] == [512, 128] and arms[0].settings["model"]["max_seq_len"] == 512
    hybrid = next(a for a in arms if a.labels["kind"] == "hybrid-gated_delta")
    assert hybrid.settings["model"]["n_layer"] == 8  # Based's block: a convolution layer before each of 4 mixers
    assert hybrid.settings["attn"]["pattern"] == ["baseconv", "gated_delta"] * 3 + ["baseconv", "softmax"]
    mha = next(a for a in arms if a.labels["kind"] == "mha")
    assert (mha.settings["model"]["n_layer"], mha.settings["model"]["mlp"]) == (2, "none")  # Based's two layers
    assert arms[0].settings["data"]["filler"] == "random"
    additive = [a for a in arms if a.labels["kind"] == "additive"]
    assert [(a.settings["model"]["d_model"], a.settings["attn"]["n_kv_head"]) for a in additive] == [
        (32, 2)]  # its K/V heads at width 32, the one width its step cost allows: 1, 2, 4


def test_based_block_puts_a_gated_convolution_before_each_mixer_layer_and_no_mlp():
    """zoology's Hybrid of [BaseConv, mixer] with an Identity state mixer: layer 2i the convolution, layer
    2i+1 the kind's own layer with its options; the filler random, as the paper's random_non_queries."""
    arms = planned("preset=frontier", "kinds=[mqa]", "extra_kinds=[{name: based, attn: hybrid, pattern: [linear, "
                   "sliding], feature_map: taylor, window: 16}]", "frontier.block=based", "frontier.short_conv=4",
                   "frontier.n_layer=2", "frontier.lr=[0.01]", "frontier.knobs.mqa=[{width: 32}]",
                   "frontier.knobs.based=[{n_head: 8}]")
    mqa, based = (a.settings for a in arms)
    for arm, mixers in ((mqa, ["softmax"]), (based, ["linear", "sliding"])):
        model, attn = arm["model"], arm["attn"]
        assert (model["n_layer"], model["mlp"], model["short_conv"]) == (4, "none", 0)
        assert attn["pattern"] == [k for mixer in mixers for k in ("baseconv", mixer)] and attn["taps"] == 4
        assert arm["data"]["filler"] == "random"
    assert mqa["attn"]["n_kv_head"] == 1 and mqa["model"]["d_model"] == 32
    assert (based["attn"]["feature_map"], based["attn"]["window"], based["model"]["n_head"]) == ("taylor", 16, 8)
    model = lm.Transformer(model_config_of(OmegaConf.create(mqa), 512))
    assert [type(b.attn).__name__ for b in model.blocks] == ["BaseConv", "SoftmaxAttention"] * 2
    assert all(b.mlp is None for b in model.blocks)


@pytest.mark.parametrize(("overrides", "message"), [
    (["frontier.test=[[16,2]]"], r"^frontier.test=\[\[16, 2\]\] has no sequence longer than the longest trained"),
    (["frontier.train=[[16,8]]"], r"^frontier.train entry \[16, 8\]: data.pairs=8 does not fit data.seq_len=16"),
    (["frontier.train=[[16]]"], r"^frontier.train entry \[16\] must be \[seq_len, pairs\]"),
    (["frontier.train=[[16,2],[16,2]]"], r"names a \[seq_len, pairs\] more than once"),
    (["frontier.test=[]"], r"^frontier.test=\[\] is empty"),
    (["frontier.knobs=5"], r"^frontier.knobs=5 must be a mapping"),
    (["frontier.knobs={mha: 16}"], r"^frontier.knobs.mha=16 must be a list of state sizes"),
    (["frontier.knobs.based=[{width: 16, window: 8}]", "extra_kinds=[{name: based, attn: hybrid, "
      "pattern: [linear, linear]}]"], r"^frontier.knobs.based width=16, window=8: .*option\(s\) \['window'\]"),
    (["frontier.knobs.mha=[16]"], r"^frontier.knobs.mha entry 16 must be a mapping of knobs"),
    # a kind added as the hint to `frontier.knobs={bogus: ...}` says: refused, where it was once ignored
    (["+frontier.knobs.bogus=[{width: 16}]"], r"^frontier.knobs.bogus names no kind this study could compare; "
                                              r"the kinds are .*linear-taylor"),
    (["frontier.knobs.mha=[{window: 4}]"], r"^frontier.knobs.mha window=4: window is not an option of mha's attention"),
    (["frontier.knobs.mha=[{width: 30}]"], r"^frontier.knobs.mha width=30: .*head_dim=15"),
    (["frontier.still_learning=-1"], r"^frontier.still_learning=-1 must be"),
    (["frontier.lr=[0.01,0.01]"], r"names a learning rate more than once"),
    (["frontier.block=based", "frontier.short_conv=1"], r"^frontier.short_conv=1 leaves Based's block no convolution"),
    (["frontier.block=dense"], r"^frontier.block='dense' is not one of \['based', 'transformer'\]"),
    (["frontier.filler=noise"], r"^frontier.filler='noise' is not one of \['pad', 'random'\]"),
    (["frontier.schedule=constant", "frontier.examples=null"], r"^frontier.examples=null makes the examples "),
    (["frontier.train_examples=[100, 20, 20]"], r"^frontier.train_examples=\[100, 20, 20\] gives 3 counts for the "
                                                r"2 cells of frontier.train: one per cell, in its order$"),
    (["frontier.train_examples=[100, 0]"], r"^frontier.train_examples entry=0 must be an integer >= 1$"),
    (["frontier.rates_at=best"], r"^frontier.rates_at='best' is not one of \['every', 'grid', 'middle'\]"),
    (["frontier.schedule=wsd"], r"^frontier.schedule='wsd' is not one of \['constant', 'cosine'\]"),
    (["frontier.steps=7"], r"^frontier.steps=7 is not a multiple of frontier.val_every=3: an arm that ran to its cap "),
])
def test_bad_frontier_settings_are_refused_before_training(overrides, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        planned(*TOY, f"out={tmp_path}", *overrides)
    assert not Path(tmp_path, "records").exists()


def test_a_kind_the_table_does_not_name_sweeps_the_width():
    arms = planned(*TOY, "kinds=[efficient]", "frontier.widths=[16,32,64]")
    assert [a.labels["point"] for a in arms] == ["width=16", "width=32", "width=64"]
    assert [a.settings["model"]["d_model"] for a in arms] == [16, 32, 64]


def test_the_default_preset_adds_a_cell_where_kinds_separate_and_the_committed_report_says_it_has_not_run():
    from lm.studies.report import recall_tables

    arms = planned("kinds=[mha]", "extra_kinds=[]", "tasks=[mqar]")  # the default grid, of one kind
    cells = {(a.labels["width"], a.labels["pairs"], a.settings["data"]["seq_len"]) for a in arms}
    assert cells == {(w, p, s) for w in (64, 128) for p, s in ((4, 64), (8, 64), (32, 256))}
    committed = json.loads((Path(__file__).resolve().parents[1] / "docs" / "compare" / "results.json").read_text())
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        today = compose(config_name="compare")
    settings = {**committed["settings"], "mqar": {**committed["settings"]["mqar"], "pairs": list(today.mqar.pairs),
                                                  "seq_len": list(today.mqar.seq_len)}}
    table = "\n".join(recall_tables(committed["records"], settings))
    header = next(line for line in table.splitlines() if line.startswith("| kind | d64 / 4"))
    assert header == "| kind | d64 / 4 | d64 / 8 | d64 / 32 | d128 / 4 | d128 / 8 | d128 / 32 |"
    mha = next(line for line in table.splitlines() if line.startswith("| mha |"))
    assert mha.count("not yet run") == 2 and mha.split(" | ")[1][0].isdigit()
    additive = next(line for line in table.splitlines() if line.startswith("| additive |"))
    assert "not yet run" not in additive  # its own settings plan d64 / 4 only, which ran
    # the committed settings themselves render as before: no column the records lack
    assert "not yet run" not in "\n".join(recall_tables(committed["records"], committed["settings"]))
