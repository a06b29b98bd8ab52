"""The studies' engine (lm/studies/engine.py), its loss evaluator, decode-speed measurer and
report set-up, without training anything."""

import json
import logging
import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lm.data.mqar import IGNORE
from lm.model.config import ModelConfig
from lm.model.transformer import Transformer
from lm.studies.decode_speed import decode_speed
from lm.studies.engine import Arm, StepCap, import_records, machine, ran_on_machine, run_arms, sealed
from lm.studies.report import pyplot, write_results
from lm.training.scoring import evaluate_loss
from lm.util.errors import DataError, Interrupted, RunInterrupted

DOCS = Path(__file__).resolve().parents[1] / "docs"


class Counting:
    """An arm's work: counts its calls, prints what a training run would, returns its figures."""

    def __init__(self, value: float, fail: bool = False):
        self.value, self.fail, self.calls = value, fail, 0

    def __call__(self) -> dict:
        self.calls += 1
        print("epoch 0: lots of training output")
        if self.fail:
            raise RuntimeError("loss is nan\nat step 3")
        return {"loss": self.value, "history": [(1, self.value)]}


def arms_of(work: dict[str, Counting], settings: dict[str, dict], logs=None) -> list[Arm]:
    return [Arm(name, settings[name], run, labels={"group": name[0]}, log=logs / f"{name}.log" if logs else None)
            for name, run in work.items()]


def describe(record: dict) -> str:
    return f"{record['arm']} loss {record['loss']}"


def progress(capsys) -> list[str]:
    return capsys.readouterr().out.splitlines()


def test_each_arm_runs_once_prints_one_line_and_leaves_a_record_with_every_setting(tmp_path, capsys):
    work = {"a": Counting(1.0), "b": Counting(2.0), "c": Counting(3.0)}
    settings = {"a": {"lr": 0.1, "steps": [1, 2]}, "b": {"lr": 0.2, "steps": [1, 2]}, "c": {"lr": 0.3, "steps": [1]}}
    started = time.perf_counter()
    records = run_arms(arms_of(work, settings, tmp_path / "logs"), tmp_path / "records", describe)
    elapsed = time.perf_counter() - started
    lines = progress(capsys)
    assert [line.rsplit("  (", 1)[0] for line in lines] == ["[1/3] a loss 1.0", "[2/3] b loss 2.0", "[3/3] c loss 3.0"]
    assert all(line.endswith(" s)") for line in lines)  # the arm's own output went to its log instead
    assert (tmp_path / "logs" / "a.log").read_text() == "epoch 0: lots of training output\n"
    stored = json.loads((tmp_path / "records" / "b.json").read_text())
    assert stored == records[1]
    assert stored["settings"] == settings["b"] and stored["group"] == "b" and stored["history"] == [[1, 2.0]]
    # each arm's time is its own part of the run's: the three add up to no more than the whole call
    assert all(r["seconds"] >= 0 for r in records) and sum(r["seconds"] for r in records) <= elapsed
    assert sorted(p.name for p in (tmp_path / "records").iterdir()) == ["a.json", "b.json", "c.json"]  # no temporaries


def test_a_repeat_reuses_records_whose_settings_are_equal_and_reruns_the_changed_one(tmp_path, capsys):
    settings = {"a": {"lr": 0.1}, "b": {"lr": 0.2, "steps": (1, 2)}, "c": {"lr": 0.3}}
    first = run_arms(arms_of({n: Counting(1.0) for n in settings}, settings, tmp_path), tmp_path, describe)
    progress(capsys)
    work = {"a": Counting(9.0), "b": Counting(9.0), "c": Counting(9.0)}
    changed = {**settings, "c": {"lr": 0.31}}
    again = run_arms(arms_of(work, changed, tmp_path), tmp_path, describe)
    lines = progress(capsys)
    assert [w.calls for w in work.values()] == [0, 0, 1]  # a tuple equals the list its record holds
    assert [line.endswith("(done before)") for line in lines] == [True, True, False, False]
    assert lines[2] == "[3/3] c: its settings changed (lr 0.3 -> 0.31); running it again"
    assert again[:2] == first[:2] and again[2]["loss"] == 9.0 and again[2]["settings"] == {"lr": 0.31}


def test_the_rerun_note_names_changed_nested_settings_and_counts_the_rest(tmp_path, capsys):
    old = {"speed": {"new_tokens": 8, "contexts": [128]}, "corpus_fingerprint": "aa", "lr": 1, "seed": 0}
    run_arms(arms_of({"a": Counting(1.0)}, {"a": old}), tmp_path, describe)
    progress(capsys)
    new = {"speed": {"new_tokens": 100, "contexts": [128, 512]}, "corpus_fingerprint": "bb", "lr": 2, "seed": 0}
    run_arms(arms_of({"a": Counting(1.0)}, {"a": new}), tmp_path, describe)
    assert progress(capsys)[0] == ("[1/1] a: its settings changed (corpus_fingerprint 'aa' -> 'bb', lr 1 -> 2, "
                                   "speed.contexts [128] -> [128, 512] and 1 more); running it again")


DAMAGES = {
    "cut short": lambda text, record: text[: len(text) // 2],
    "a figure removed": lambda text, record: json.dumps({k: v for k, v in record.items() if k != "loss"}),
    "a figure of the wrong type": lambda text, record: json.dumps({**record, "loss": "1.0"}),
    "a figure edited": lambda text, record: json.dumps({**record, "loss": 0.5}),
    "a list": lambda text, record: json.dumps([record]),
    "deep nesting": lambda text, record: "[" * 100_000 + "]" * 100_000,
    "no digest (an older format)": lambda text, record: json.dumps({k: v for k, v in record.items() if k != "digest"}),
    "settings not a mapping": lambda text, record: json.dumps({**record, "settings": [1]}),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_record_is_run_again_with_a_note(tmp_path, capsys, damage):
    settings = {"a": {"lr": 0.1}}
    run_arms(arms_of({"a": Counting(1.0)}, settings), tmp_path, describe)
    path = tmp_path / "a.json"
    path.write_text(DAMAGES[damage](path.read_text(), json.loads(path.read_text())))
    progress(capsys)
    work = {"a": Counting(2.0)}
    assert run_arms(arms_of(work, settings), tmp_path, describe)[0]["loss"] == 2.0 and work["a"].calls == 1
    lines = [line for line in progress(capsys) if line.startswith("[")]  # without the arm's own output
    assert lines[0] == "[1/1] a: its record a.json is damaged (not the file the study wrote); running it again"
    assert len(lines) == 2 and json.loads(path.read_text())["loss"] == 2.0


def results_of(records: list[dict], path: Path) -> Path:
    """A study's results.json holding `records`, as a report writes it."""
    path.write_text(json.dumps({"machine": {}, "settings": {}, "records": records}, indent=1))
    return path


def test_records_from_a_results_file_are_taken_when_their_settings_hold_and_the_arms_not_run_again(tmp_path):
    settings = {"a": {"lr": 0.1}, "b": {"lr": 0.2}, "c": {"lr": 0.3}, "d": {"lr": 0.4}}
    elsewhere = run_arms(arms_of({n: Counting(1.0) for n in settings}, settings), tmp_path / "there", describe)
    edited = {**elsewhere[3], "loss": 0.5}  # its digest no longer matches: never taken
    failed = sealed({"arm": "d", "error": "RuntimeError: loss is nan", "settings": settings["d"]})
    odd = [sealed({**elsewhere[0], "arm": "z"}), sealed({**elsewhere[0], "arm": ["a"]}), 7]  # the last two: hostile
    source = results_of([*elsewhere[:3], edited, failed, *odd], tmp_path / "results.json")
    here = tmp_path / "here"
    local = run_arms(arms_of({"a": Counting(7.0)}, settings), here, describe)[0]  # finished here: kept
    changed = {**settings, "c": {"lr": 0.31}}
    line = import_records(arms_of({n: Counting(0.0) for n in changed}, changed), here, source)
    assert line == (f"records_from={source}: 1 finished arms taken; left out: 1 finished here already, "
                    "1 of other settings, 1 unfinished, 2 not in this study, 2 edited or damaged")
    assert json.loads((here / "a.json").read_text()) == local
    assert json.loads((here / "b.json").read_text()) == elsewhere[1]
    assert not (here / "c.json").exists() and not (here / "d.json").exists() and not (here / "z.json").exists()
    work = {n: Counting(2.0) for n in changed}
    records = run_arms(arms_of(work, changed), here, describe)
    assert [w.calls for w in work.values()] == [0, 0, 1, 1]  # only the arms without a taken record ran
    assert records[1] == elsewhere[1]


def test_records_from_takes_timings_from_this_machine_only_and_the_records_a_partial_report_holds_apart(tmp_path):
    settings = {"speed": {"contexts": [64]}, "recall": {"lr": 0.1}, "lm": {"lr": 0.2}}
    there = run_arms(arms_of({n: Counting(1.0) for n in settings}, settings), tmp_path / "there", describe)
    assert all(ran_on_machine(r, machine()) for r in there)  # each record names the machine it ran on
    timed_elsewhere = sealed({**there[0], "ran_on": {**there[0]["ran_on"], "cpu": "a faster CPU"}})
    older = sealed({**there[0], "ran_on": {"host": "vm", "pid": 1}})  # from before records named their machine
    path = tmp_path / "results.json"  # a report_only report: the lm entry waits for another arm
    path.write_text(json.dumps({"records": [timed_elsewhere, older, there[1], there[1]], "waiting": [there[2]]}))
    here = tmp_path / "here"

    def import_():
        arms = arms_of({n: Counting(0.0) for n in settings}, settings)
        return import_records(arms, here, path, times_this_machine=lambda arm: arm.name == "speed")

    assert import_() == (f"records_from={path}: 2 finished arms taken; left out: 2 timed on another machine, "
                         "1 given twice")
    assert not (here / "speed.json").exists()
    assert [json.loads((here / f"{n}.json").read_text()) for n in ("recall", "lm")] == there[1:]
    path.write_text(json.dumps({"records": [there[0]]}))  # the same timings, measured on this machine
    assert import_() == f"records_from={path}: 1 finished arms taken"
    assert json.loads((here / "speed.json").read_text()) == there[0]


def test_the_report_names_the_machines_its_arms_ran_on():
    from lm.studies.report import machine_line

    here = {"cpu": "AMD EPYC", "threads": 2, "gpu": None, "torch": "2.13.0"}
    other = {**here, "threads": 1}
    records = [{"seconds": 60, "ran_on": {"host": "a", **other}}, {"seconds": 60, "ran_on": {"host": "b", **other}},
               {"seconds": 60, "ran_on": {"host": "c"}}]
    assert machine_line({"machine": here, "records": records}) == (
        "Machine: AMD EPYC (2 threads), torch 2.13.0; its arms took 3.0 min of training and measuring in all (summed "
        "over the records, also those a repeated command reused). Its arms ran on: AMD EPYC (1 threads), torch "
        "2.13.0: 2 arms; 1 arms recorded before records named their machine.")
    assert machine_line({"machine": here, "records": records[2:]}).endswith("a repeated command reused).")


@pytest.mark.parametrize(("content", "message"), [
    (None, "no such file"),
    ("{\"records\": [", "is not a readable results.json"),
    ("[1, 2]", "holds no list of records"),
    ("{\"records\": {}}", "holds no list of records"),
])
def test_a_records_from_file_that_is_not_a_results_file_is_refused_in_one_line(tmp_path, content, message):
    source = tmp_path / "results.json"
    if content is not None:
        source.write_text(content)
    with pytest.raises(DataError, match=message) as caught:
        import_records(arms_of({"a": Counting(1.0)}, {"a": {}}), tmp_path / "records", source)
    assert "\n" not in str(caught.value) and not (tmp_path / "records").exists()


class Stopping:
    """An arm's work that a signal stops: in training (RunInterrupted after saving its checkpoint,
    as lm.training.interrupt does) or while measuring (a real signal to this process); then, asked
    again, it finishes and says whether it was asked to resume."""

    def __init__(self, checkpoint: Path, in_training: bool, signum: int = signal.SIGINT):
        self.checkpoint, self.in_training, self.signum = checkpoint, in_training, signum
        self.resumed: list[bool] = []

    def __call__(self, resume: bool = False) -> dict:
        self.resumed.append(resume)
        if len(self.resumed) == 1:
            self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
            self.checkpoint.write_text("state at step 7")
            if self.in_training:
                raise RunInterrupted(self.signum, 7, self.checkpoint)
            os.kill(os.getpid(), self.signum)  # the engine's handler raises here, as a signal while measuring would
            raise AssertionError("the signal did not stop the arm")
        return {"loss": 1.5, "history": []}


@pytest.mark.parametrize(("in_training", "signum"), [(True, signal.SIGINT), (True, signal.SIGTERM),
                                                      (False, signal.SIGINT), (False, signal.SIGTERM)])
def test_a_stopped_arm_says_so_in_one_line_and_the_same_command_continues_it(tmp_path, capsys, in_training, signum):
    checkpoint = tmp_path / "runs" / "b" / "last.ckpt"
    work = Stopping(checkpoint, in_training, signum)
    first = Counting(1.0)
    arms = [Arm("a", {"x": 1}, first), Arm("b", {"x": 2}, work, checkpoint=checkpoint), Arm("c", {"x": 3}, first)]
    before = signal.getsignal(signal.SIGINT)  # Python's default handler, or SIG_IGN in a job started in the background
    with pytest.raises(Interrupted) as stopped:
        run_arms(arms, tmp_path / "records", describe)
    name = signal.Signals(signum).name
    where = "at step 7" if in_training else "while it ran"
    assert str(stopped.value) == (f"[2/3] b stopped by {name} {where}; the arms before it are kept, and the same "
                                  f"command continues it from {checkpoint}")
    assert stopped.value.exit_code == 128 + signum and first.calls == 1
    assert signal.getsignal(signal.SIGINT) is before  # the engine's handlers are gone
    assert json.loads((tmp_path / "records" / "b.json").read_text())["interrupted"] is True
    progress(capsys)

    records = run_arms(arms, tmp_path / "records", describe)
    assert work.resumed == [False, True] and first.calls == 2  # a was done before, c is new
    assert progress(capsys)[:2] == ["[1/3] a loss 1.0  (done before)",
                                    f"[2/3] b: continuing from {checkpoint}, where it was interrupted"]
    assert records[1]["loss"] == 1.5 and "interrupted" not in records[1]


def test_an_arm_without_its_checkpoint_runs_again_from_the_start_and_a_fresh_run_drops_a_stale_one(tmp_path, capsys):
    checkpoint = tmp_path / "last.ckpt"
    work = Stopping(checkpoint, in_training=True)
    arms = [Arm("b", {"x": 2}, work, checkpoint=checkpoint)]
    with pytest.raises(Interrupted):
        run_arms(arms, tmp_path / "records", describe)
    checkpoint.unlink()
    run_arms(arms, tmp_path / "records", describe)
    assert work.resumed == [False, False]

    checkpoint.write_text("a run of other settings")
    changed = [Arm("b", {"x": 3}, lambda resume=False: {"loss": 2.0, "kept": checkpoint.exists()},
                   checkpoint=checkpoint)]
    assert run_arms(changed, tmp_path / "records", describe)[0]["kept"] is False


class Capped:
    """An arm's work under a step cap (settings {"cap": n, "x": ...}): a run that stops at `stop` steps,
    or at its cap if sooner; continued, it goes on from the steps its checkpoint holds."""

    def __init__(self, checkpoint: Path, stop: int):
        self.checkpoint, self.stop, self.calls = checkpoint, stop, []

    def arm(self, name: str, cap: int, x: int = 1) -> Arm:
        def work(resume: bool = False) -> dict:
            start = int(self.checkpoint.read_text()) if resume else 0
            self.calls.append((resume, start))
            steps = min(self.stop, cap)
            self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
            self.checkpoint.write_text(str(steps))
            return {"loss": 1.0 / steps, "steps": steps, "history": []}

        return Arm(name, {"trainer": {"max_steps": cap}, "x": x}, work, checkpoint=self.checkpoint,
                   cap=StepCap("trainer.max_steps", lambda r: r["steps"] >= r["settings"]["trainer"]["max_steps"]))


def test_a_raised_cap_keeps_a_record_that_stopped_before_it_and_continues_one_that_ran_to_it(tmp_path, capsys):
    early, capped = Capped(tmp_path / "runs" / "a.ckpt", stop=60), Capped(tmp_path / "runs" / "b.ckpt", stop=500)
    records = tmp_path / "records"
    run_arms([early.arm("a", 100), capped.arm("b", 100)], records, describe)
    progress(capsys)
    again = run_arms([early.arm("a", 300), capped.arm("b", 300)], records, describe)
    lines = progress(capsys)
    assert early.calls == [(False, 0)]  # stopped at 60 of 100: the run under 300 is the same run
    assert lines[0].endswith("(done before)") and again[0]["steps"] == 60
    assert json.loads((records / "a.json").read_text())["settings"]["trainer"]["max_steps"] == 300
    assert capped.calls == [(False, 0), (True, 100)]  # ran to 100: continued from its checkpoint's step
    assert lines[1] == (f"[2/2] b: continuing from {capped.checkpoint}: it ran to its cap, raised "
                        "(trainer.max_steps 100 -> 300)")
    assert again[1]["steps"] == 300 and again[1]["settings"]["trainer"]["max_steps"] == 300
    # a lower cap, or another setting changed beside the cap, is another run: from the start
    run_arms([capped.arm("b", 200)], records, describe)
    run_arms([early.arm("a", 400, x=2)], records, describe)
    assert capped.calls[-1] == (False, 0) and early.calls[-1] == (False, 0)
    # without its checkpoint, a run that ran to its cap runs again from the start, saying so
    capped.checkpoint.unlink()
    run_arms([capped.arm("b", 900)], records, describe)
    assert capped.calls[-1] == (False, 0) and "left no checkpoint; running it again" in progress(capsys)[-2]


def test_records_from_takes_a_record_that_stopped_before_a_cap_since_raised(tmp_path):
    early, capped = Capped(tmp_path / "a.ckpt", stop=60), Capped(tmp_path / "b.ckpt", stop=500)
    source = results_of(run_arms([early.arm("a", 100), capped.arm("b", 100)], tmp_path / "there", describe),
                        tmp_path / "results.json")
    line = import_records([early.arm("a", 300), capped.arm("b", 300)], tmp_path / "here", source)
    # the one that ran to its cap needs its checkpoint to continue, which a results file does not carry
    assert line == f"records_from={source}: 1 finished arms taken; left out: 1 of other settings"
    taken = json.loads((tmp_path / "here" / "a.json").read_text())
    assert taken["steps"] == 60 and taken["settings"]["trainer"]["max_steps"] == 300
    # a checkpoint left here by another run of the arm is dropped with the taking: never continued as this record's
    assert not early.checkpoint.exists() and capped.checkpoint.exists()


def test_a_failing_arm_is_recorded_stops_the_study_and_runs_again_next_time(tmp_path, capsys):
    settings = {"a": {"lr": 0.1}, "b": {"lr": 0.2}, "c": {"lr": 0.3}}
    work = {"a": Counting(1.0), "b": Counting(2.0, fail=True), "c": Counting(3.0)}
    lightning = logging.getLogger("lightning.pytorch")
    level = lightning.level
    with pytest.raises(RuntimeError, match="loss is nan"):
        run_arms(arms_of(work, settings, tmp_path / "logs"), tmp_path / "records", describe)
    assert lightning.level == level  # quieted while the arms ran, not for what the process runs next
    lines = progress(capsys)
    assert len(lines) == 2 and lines[1].startswith("[2/3] b failed after 0 s: loss is nan at step 3 (its log: ")
    assert work["c"].calls == 0
    failed = json.loads((tmp_path / "records" / "b.json").read_text())
    assert failed["error"] == "RuntimeError: loss is nan at step 3" and failed["settings"] == {"lr": 0.2}
    assert failed["group"] == "b" and "loss" not in failed
    assert (tmp_path / "records" / "a.json").is_file() and not (tmp_path / "records" / "c.json").exists()

    work = {"a": Counting(1.0), "b": Counting(2.0), "c": Counting(3.0)}
    run_arms(arms_of(work, settings, tmp_path / "logs"), tmp_path / "records", describe)
    assert [w.calls for w in work.values()] == [0, 1, 1]


def test_two_arms_of_one_name_are_refused_before_either_runs(tmp_path):
    work = Counting(1.0)
    arms = [Arm("a", {"x": 1}, work), Arm("a", {"x": 2}, work)]
    with pytest.raises(ValueError, match=r"arm names \['a'\] more than once"):
        run_arms(arms, tmp_path, describe)
    assert work.calls == 0


def test_results_hold_the_records_and_only_plots_with_something_to_show_are_written(tmp_path, capsys):
    def line_plot(records):
        fig, ax = pyplot().subplots()
        ax.plot([r["loss"] for r in records])
        return fig

    results = {"seconds": 90.0, "records": [{"arm": "a", "loss": 1.0}, {"arm": "b", "loss": 0.5}]}
    write_results(tmp_path, results, "| table |\n", {"loss.png": line_plot, "empty.png": lambda records: None})
    assert json.loads((tmp_path / "results.json").read_text()) == results
    assert (tmp_path / "results.md").read_text() == "| table |\n"
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "empty.png").exists()
    assert progress(capsys)[-1] == f"this command took 1.5 min; wrote results.json, results.md, loss.png " \
                                   f"under {tmp_path}"
    assert pyplot().get_backend().lower() == "agg"

    (tmp_path / "empty.png").write_bytes(b"a plot of an earlier run")
    write_results(tmp_path, results, "| table |\n", {"loss.png": line_plot, "empty.png": lambda records: None})
    assert not (tmp_path / "empty.png").exists()  # it would show arms these results do not hold


def test_results_are_written_only_once_every_part_of_the_report_is_made(tmp_path, capsys):
    write_results(tmp_path, {"seconds": 1.0, "records": []}, "old table\n", {})
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def failing_plot(records):
        raise KeyError("contexts")

    with pytest.raises(KeyError):
        write_results(tmp_path, {"seconds": 2.0, "records": [{"arm": "a"}]}, "new table\n", {"x.png": failing_plot})
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def tiny_model(**changes) -> Transformer:
    torch.manual_seed(0)
    settings = {"vocab_size": 50, "n_layer": 2, "d_model": 32, "n_head": 4, "n_kv_head": 2, "d_ff": 64,
                "max_seq_len": 64} | changes
    return Transformer(ModelConfig(**settings)).eval()


def test_the_loss_evaluator_weights_every_scored_target_alike_over_text_and_recall_batches():
    model = tiny_model()
    text = [torch.randint(0, 50, (3, 17)), torch.randint(0, 50, (1, 9))]  # (B, T + 1) each, of different sizes
    inputs, targets = torch.randint(0, 50, (2, 8)), torch.full((2, 8), IGNORE)
    targets[0, 3], targets[1, 7] = 4, 11  # two answers scored, the rest not
    with torch.no_grad():
        logits = [model(b[:, :-1]) for b in text] + [model(inputs)]
    scored = list(zip(logits, [b[:, 1:] for b in text] + [targets], strict=True))
    nll = [F.cross_entropy(lg.flatten(0, 1).double(), t.flatten(), reduction="sum", ignore_index=IGNORE)
           for lg, t in scored]
    right = sum(int((lg.argmax(-1) == t).sum()) for lg, t in scored)  # IGNORE is never an arg-max
    totals = evaluate_loss(model, [*text, (inputs, targets)])
    assert totals.targets == 3 * 16 + 8 + 2
    assert totals.nll == pytest.approx(float(sum(nll)), rel=1e-5)
    assert totals.loss == pytest.approx(float(sum(nll)) / totals.targets, rel=1e-5)
    assert totals.correct == right and totals.accuracy == right / totals.targets


def test_decode_speed_counts_the_prompt_and_new_tokens_and_the_cache_they_fill():
    measured = decode_speed(tiny_model(), list(range(1, 41)), 8)
    assert measured.tokens == 48
    head_dim = 32 // 4
    # keys and values of 2 K/V heads in 2 layers, float32, for each of the 48 positions
    assert measured.cache_bytes == 48 * 2 * 2 * 2 * head_dim * 4
    assert 0 < measured.tokens_per_s < math.inf and 0 < measured.prefill_s < math.inf


class TimedRun:
    """A stand-in for `stream`'s run: every row's tokens and the stats a run of that size reports."""

    def __init__(self, runs: list, prompts: list, new_tokens: int, compile: bool = False):
        self.stats = {"prefill_s": 0.25, "decode_s": 1.5, "first_step_s": 0.5, "new_tokens": len(prompts) * new_tokens,
                      "cache_bytes": 1000}
        self.rows, self.new_tokens = len(prompts), new_tokens
        runs.append((len(prompts), len(prompts[0]), new_tokens, compile))

    def __iter__(self):
        yield from [[1] * self.rows] * self.new_tokens


def test_decode_speed_times_the_steps_after_the_first_of_a_run_after_a_warm_up(monkeypatch):
    """tokens/s counts each row's tokens of the steps after the first (the first token comes from the
    prefill, the first step compiles), over decoding's time less the first step's."""
    import lm.studies.decode_speed as measurer

    runs = []
    monkeypatch.setattr(measurer, "stream", lambda model, prompts, n, compile: TimedRun(runs, prompts, n, compile))
    measured = decode_speed(tiny_model(), list(range(1, 101)), 10, batch=3, compile=True)
    # the warm-up: a short prompt (the long one's end) and a few tokens, as compiled as the measured run
    assert runs == [(3, measurer.WARM_UP_PROMPT, measurer.WARM_UP_TOKENS, True), (3, 100, 10, True)]
    assert measured.tokens_per_s == 3 * (10 - 2) / (1.5 - 0.5)
    assert (measured.prefill_s, measured.cache_bytes, measured.tokens) == (0.25, 1000, 3 * 100 + 3 * 10)


@pytest.mark.parametrize("study", ["compare", "compare/previous-recipe", "compare/recall",
                                   "uptrain_study"])
def test_the_committed_results_still_render_to_their_committed_tables(study):
    from lm.studies.report import ablation_table, comparison_table, lm_loss_plot, mqar_plot, uptraining_plot

    folder = DOCS / study
    results = json.loads((folder / "results.json").read_text())
    if study.startswith("compare"):
        table, plots = comparison_table(results), [mqar_plot, lm_loss_plot]
    else:
        table, plots = ablation_table(results["records"]), [uptraining_plot]
    assert table == (folder / "results.md").read_text()
    # every plot the study's records have something for (a recall-only study has no loss curves)
    tasks = {r.get("task") for r in results["records"]}
    needs = {mqar_plot: "mqar", lm_loss_plot: "lm"}
    for plot in plots:
        assert (plot(results["records"]) is not None) == (needs.get(plot) in tasks if plot in needs else True)
    pyplot().close("all")


def test_a_stop_wrapped_in_a_librarys_error_is_still_a_stop():
    """torch.compile raises InductorError from the SIGTERM that arrived while it compiled: the study
    must still see the stop (one line, the arm continued later), not a failure with a traceback."""
    from lm.studies.engine import interruption_within
    from lm.util.errors import Interrupted

    def wrapped(by_cause: bool) -> Exception:
        try:
            try:
                raise Interrupted(15, "stopped by SIGTERM")
            except Interrupted as stop:
                if by_cause:
                    raise RuntimeError("InductorError: compiling failed") from stop
                raise RuntimeError("while handling it")  # noqa: B904 - the stop as the implicit context
        except RuntimeError as e:
            return e

    for by_cause in (True, False):
        found = interruption_within(wrapped(by_cause))
        assert isinstance(found, Interrupted) and found.signum == 15
    assert interruption_within(ValueError("a real failure")) is None


def test_the_loss_curves_say_which_part_of_the_split_they_measure():
    from lm.studies.report import validation_label

    settings = {"trainer": {"limit_val_batches": 10}, "data": {"batch_size": 16}, "model": {"max_seq_len": 256}}
    assert validation_label(settings) == "validation loss (the split's first 41k tokens)"  # 10 x 16 x 256 = 40,960
    assert validation_label({**settings, "trainer": {"limit_val_batches": None}}) == "validation loss"
