"""The one runner of a study's arms (the attention comparison, the uptraining ablation).

An arm is a name, every setting its figures depend on, and the function that produces them.
Each finished arm leaves <records>/<name>.json: its labels, its figures, the seconds it took,
its settings and a digest of all of it. A repeated command reuses a record whose stored settings
equal the requested ones; a record whose settings differ, or that is damaged (not JSON, edited,
cut short: its digest no longer matches), runs its arm again after a one-line note naming why.
So a changed setting reruns exactly the arms it touches. Each arm prints one line; what it says
while running (training logs, Lightning) goes to its log file.

An arm that raises stops the study, as a failed training run stops `scripts/train.py`; its
record holds the error instead of figures, so it is never reused, and the records finished
before it are kept. A signal (Ctrl-C, a scheduler's SIGTERM) stops the study with one line and
exit code 128 + the signal: training saves its `last.ckpt` on the way out, the record says the
arm was interrupted, and the same command continues that arm from its checkpoint when the arm
has one (`Arm.checkpoint`), or runs it again.

An arm may name the setting that caps its steps (`Arm.cap`) when a run under a higher cap is the
same run made longer (a schedule and data that do not depend on the cap). Raising the cap then
keeps every record whose run stopped before its old cap (it would stop at the same step under the
new one) and continues each that ran to its cap from its checkpoint, instead of running either again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from lm.data.corpora import digest
from lm.studies.records import bad_value
from lm.util.errors import DataError, Interrupted, RunInterrupted, one_line
from lm.util.files import make_folder, write_atomically


@dataclass(frozen=True)
class StepCap:
    """The setting that caps an arm's steps, where the run under a higher cap is this run made
    longer: a record that stopped before its cap stands under any higher one, and one that ran to
    its cap continues from the arm's checkpoint."""

    setting: str  # flattened, as `flat` names it: "trainer.max_steps"
    ran_to_cap: Callable[[dict], bool]  # whether a finished record's run took every step its cap allowed


@dataclass
class Arm:
    name: str  # the record's file name: records/<name>.json
    settings: dict  # every setting the figures depend on; JSON data
    run: Callable[..., dict]  # produces the figures; run(resume=True) continues from `checkpoint`
    labels: dict = field(default_factory=dict)  # what the tables group by, known before running
    log: Path | None = None  # where the arm's own output goes; None: the terminal
    checkpoint: Path | None = None  # where an interrupted run of the arm leaves its state, if it leaves one
    cap: StepCap | None = None  # the setting a record of a lower cap is kept or continued under


def recorded_settings(run_cfg: DictConfig) -> dict:
    """A training arm's settings as its record holds them: the whole run config but the folder its
    checkpoints go to, a path under the study's `out` that the figures do not depend on. Were it
    kept, a study moved to another folder or machine (records_from=...) would run every arm again."""
    settings = OmegaConf.to_container(run_cfg, resolve=True)
    settings.pop("checkpoint_dir", None)
    return settings


def as_json_data(value):
    """`value` as it reads back from its JSON record (tuples become lists), so a fresh record and
    a reused one compare equal."""
    return json.loads(json.dumps(value))


def sealed(record: dict) -> dict:
    """The record with the digest of its content, which a damaged or edited record fails."""
    content = {k: v for k, v in record.items() if k != "digest"}
    return {**content, "digest": digest(content)}


def is_sealed(record) -> bool:
    return isinstance(record, dict) and isinstance(record.get("digest"), str) and sealed(record) == record


@dataclass
class Stored:
    """What <records>/<name>.json says of an arm: `state` is one of absent, damaged, invalid (sealed,
    but a value of no meaning: `bad_value`), failed, interrupted, changed, extend (it ran to a cap
    since raised: `Arm.cap`), done; `record` is the reusable record when done, the record so far
    when interrupted or to extend."""

    state: str
    record: dict | None = None
    changes: list[str] = field(default_factory=list)  # the settings that differ, or the bad value


# Settings the run config gained after records were written, each with the value that does what a
# record without it did: an arm planned with that value takes such a record as its own, so a study
# keeps its records until it is rerun on purpose (with another value, the arm runs again).
ADDED_SINCE_RECORDS = {
    "attn.global_every": None,  # every attn config has it since the attn schemas (lm.config.attn)
    "attn.last_kind": None,  # ... and this since the open models' stacks (conf/attn/olmo3.yaml, ...)
    "attn.rope": None,  # MLA's option since NoPE (lm/attention/mla.py); null: RoPE, as before
    "attn.latent_norm": None,  # MLA's (and DSA's) since Kimi Linear's export; null: a linear latent, as before
    "attn.gate_bias": None,  # KDA's since Kimi Linear's export; null: the gate's bias, as before
    "optim.name": "adamw",  # before optim=muon every run trained with AdamW ...
    "optim.schedule": "cosine",  # ... and a linear warm-up then cosine decay
    "optim.decay_fraction": 0.2,  # read by schedule=wsd only
    "resume": False,  # an uptraining arm's settings hold it since uptrain.py continues interrupted runs
    "trainer.skip_nonfinite": False,  # an uptraining arm's settings hold it since uptrain.py takes it
    "data.mix": None,  # a recall arm's data holds it since the frontier trains on a mix of lengths
    "data.mix_examples": None,  # ... and this since a mix's cells may hold their own counts (Based's 100k and 20k)
    "model.mlp": "swiglu",  # every model was SwiGLU before model.mlp=relu2 ...
    "model.zero_init_out": False,  # ... and initialised its output projections as GPT-2 does
    "model.norm_eps": 1e-5,  # ModelConfig's, before the model group declared it (lm/config/model.py)
    "model.qk_norm": None,  # the shape's QK-norm switch, since model=nano turned it on; null: each kind's own
    "model.rope_theta": 10000.0,  # ModelConfig's, before the model group took every field of it ...
    "model.init_std": 0.02,  # ... (lm/config/model.py)
    "logger.project": "lm",  # an uptraining arm's run records its typed logger group whole, wandb's project too
    "loss_chunk": 0,  # every run made its whole logits at once before lm.model.linear_cross_entropy
}


def same_settings(recorded: dict, planned: dict) -> bool:
    """Whether a record's settings are the planned ones: equal, but for settings added since the
    record was written that the plan leaves at the value meaning what the record did."""
    if recorded == planned:
        return True
    before, after = flat(recorded), flat(planned)
    added = after.keys() - before.keys()
    return before == {k: after[k] for k in after.keys() - added} and all(
        key in ADDED_SINCE_RECORDS and ADDED_SINCE_RECORDS[key] == after[key] for key in added)


def raised_cap(recorded: dict, planned: dict, cap: StepCap | None) -> tuple[int, int] | None:
    """(old, new) when the planned settings are the record's with `cap`'s setting raised, else None."""
    if cap is None:
        return None
    old, new = flat(recorded).get(cap.setting), flat(planned).get(cap.setting)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (old, new)) or new <= old:
        return None
    return (old, new) if same_settings(recorded, set_flat(planned, cap.setting, old)) else None


def kept_under_raised_cap(record: dict, planned: dict, cap: StepCap | None) -> dict | None:
    """A finished record whose run stopped before a cap the plan has since raised, sealed again under
    the planned settings (JSON data): the run under the higher cap is this run, step for step. None
    otherwise."""
    if ("error" in record or record.get("interrupted") or raised_cap(record["settings"], planned, cap) is None
            or cap.ran_to_cap(record)):
        return None
    return sealed({**record, "settings": planned})


def set_flat(settings: dict, key: str, value) -> dict:
    """A copy of nested `settings` with the flattened `key` ("trainer.max_steps") set to `value`."""
    head, _, rest = key.partition(".")
    return {**settings, head: set_flat(settings[head], rest, value) if rest else value}


def stored_record(path: Path, settings: dict, cap: StepCap | None = None) -> Stored:
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return Stored("absent")
    except (OSError, ValueError, RecursionError):  # unreadable, half a file, or nested past what json reads
        return Stored("damaged")
    if not is_sealed(record):
        return Stored("damaged")
    problem = bad_value(record)
    if problem is not None:
        return Stored("invalid", changes=[problem])
    planned = as_json_data(settings)
    raised = raised_cap(record["settings"], planned, cap) if "error" not in record else None
    if raised is not None:
        if record.get("interrupted"):
            return Stored("interrupted", record)
        if cap.ran_to_cap(record):
            return Stored("extend", record, changes=[f"{cap.setting} {raised[0]} -> {raised[1]}"])
        return Stored("done", kept_under_raised_cap(record, planned, cap))
    if not same_settings(record["settings"], planned):
        return Stored("changed", changes=changed_settings(record["settings"], planned))
    if "error" in record:
        return Stored("failed")
    if record.get("interrupted"):
        return Stored("interrupted", record)
    return Stored("done", record)


def flat(settings, prefix: str = "") -> dict:
    """Nested settings as {"speed.new_tokens": 8, ...}."""
    if isinstance(settings, dict) and settings:
        return {k: v for key, value in settings.items() for k, v in flat(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: settings}


def changed_settings(old: dict, new: dict) -> list[str]:
    before, after = flat(old), flat(new)
    missing = object()
    return [f"{key} {before.get(key, '(none)')!r} -> {after.get(key, '(none)')!r}"
            for key in sorted(before.keys() | after.keys()) if before.get(key, missing) != after.get(key, missing)]


def rerun_note(stored: Stored, path: Path) -> str | None:
    """Why a record on disk is not reused, in a few words; None when there is nothing to say."""
    if stored.state == "damaged":
        return f"its record {path.name} is damaged (not the file the study wrote); running it again"
    if stored.state == "changed":
        shown = ", ".join(stored.changes[:3]) + (f" and {len(stored.changes) - 3} more" if len(stored.changes) > 3
                                                 else "")
        return f"its settings changed ({shown}); running it again"
    if stored.state == "failed":
        return "it failed last time; running it again"
    if stored.state == "invalid":
        return f"its record {path.name} is set aside ({stored.changes[0]}); running it again"
    if stored.state == "extend":
        return f"it ran to its cap, raised ({stored.changes[0]}), and left no checkpoint; running it again"
    return None


def write_record(path: Path, record: dict) -> None:
    text = json.dumps(sealed(record), indent=1) + "\n"
    write_atomically(path, lambda tmp: tmp.write_text(text))


@contextlib.contextmanager
def quiet_lightning():
    """Lightning logs through handlers bound to the terminal, which redirecting an arm's output
    does not reach; below WARNING they would break the one line per arm. The levels are put
    back afterwards, so a run started later in the same process speaks as usual."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "lightning")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def run_logged(arm: Arm, resume: bool) -> dict:
    work = (lambda: arm.run(resume=True)) if resume else arm.run
    if arm.log is None:
        return work()
    make_folder(arm.log.parent)
    with open(arm.log, "a" if resume else "w") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        return work()


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGINT and SIGTERM raise Interrupted while an arm measures. Training installs its own
    handlers for its steps (it saves `last.ckpt`, then raises RunInterrupted) and puts these back."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return

    def interrupt(signum, frame):
        raise Interrupted(signum, f"stopped by {signal.Signals(signum).name}")

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_arms(arms: list[Arm], records: Path, describe: Callable[[dict], str], only: int | None = None) -> list[dict]:
    """Every arm's record, in order, reusing those whose settings match; one line per arm, from
    `describe(record)`. `only`: the index of the one arm to run (a launcher's job), numbered among all."""
    names = [arm.name for arm in arms]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"arm names {repeated} more than once: their records would overwrite each other")
    make_folder(records)
    with quiet_lightning():
        return _run_each(arms, records, describe, only)


def finished_records(arms: list[Arm], records: Path) -> tuple[list[dict], list[Arm]]:
    """The records of the arms that finished under their current settings, in order, and the arms
    that have not (absent, interrupted, failed or of other settings), running none: what a study
    can report while its other arms still run, on other machines or later."""
    done, unfinished = [], []
    for arm in arms:
        stored = stored_record(records / f"{arm.name}.json", arm.settings, arm.cap)
        if stored.state == "done":
            done.append(stored.record)
        else:
            unfinished.append(arm)
    return done, unfinished


def import_records(arms: list[Arm], records: Path, source: Path,
                   times_this_machine: Callable[[Arm], bool] = lambda arm: False) -> str:
    """Fill `records` from the records a study's results.json holds (a committed report, or one
    from another machine), so the arms they finished are not run again here. A record is taken
    when it names a planned arm, is sealed (not edited since it was written), finished, and holds
    the arm's current settings; a finished record already in `records` is kept. An arm whose
    figures are timings of the machine it ran on (`times_this_machine`) is taken only from this
    machine: one table's speeds must come from one machine. Returns one line saying what was
    taken and what was not."""
    try:
        results = json.loads(source.read_text())
    except FileNotFoundError:
        raise DataError(f"records_from={source}: no such file (give a study's results.json)") from None
    except (OSError, ValueError, RecursionError) as e:
        raise DataError(f"records_from={source} is not a readable results.json: {one_line(e)}") from None
    if not isinstance(results, dict) or not isinstance(results.get("records"), list):
        raise DataError(f"records_from={source} holds no list of records: not a study's results.json")
    # a report rendered before its study finished holds the finished arms of incomplete table
    # entries apart, under "waiting"
    waiting = results.get("waiting", [])
    given = results["records"] + (waiting if isinstance(waiting, list) else [])
    planned = {arm.name: arm for arm in arms}
    here = machine()
    counts = dict.fromkeys(("taken", "finished here already", "of other settings", "unfinished",
                            "timed on another machine", "not in this study", "given twice", "edited or damaged",
                            "with values of no meaning"), 0)
    taken, set_aside = set(), []
    for record in given:
        if not is_sealed(record):
            counts["edited or damaged"] += 1
            continue
        arm = planned.get(record.get("arm")) if isinstance(record.get("arm"), str) else None
        wanted = as_json_data(arm.settings) if arm is not None else None  # its settings as a record holds them
        problem = bad_value(record) if arm is not None else None
        if arm is None:
            counts["not in this study"] += 1
        elif problem is not None:  # named, never copied: a later plain run would read it as a finished arm
            counts["with values of no meaning"] += 1
            set_aside.append(f"{arm.name}: {problem}")
        elif arm.name in taken:
            counts["given twice"] += 1
        elif "error" in record or record.get("interrupted"):
            counts["unfinished"] += 1
        # (one that ran to a cap since raised continues from a checkpoint, which a results.json does not carry)
        elif not same_settings((record := kept_under_raised_cap(record, wanted, arm.cap) or record)["settings"],
                               wanted):
            counts["of other settings"] += 1
        elif times_this_machine(arm) and not ran_on_machine(record, here):
            counts["timed on another machine"] += 1
        elif stored_record(records / f"{arm.name}.json", arm.settings, arm.cap).state == "done":
            counts["finished here already"] += 1
        else:
            make_folder(records)
            write_record(records / f"{arm.name}.json", record)
            if arm.checkpoint is not None:  # another run's state: never to be continued as this record's
                arm.checkpoint.unlink(missing_ok=True)
            taken.add(arm.name)
            counts["taken"] += 1
    left = ", ".join(f"{n} {why}" for why, n in counts.items() if n and why != "taken")
    named = "; set aside: " + "; ".join(set_aside[:3]) + (f" and {len(set_aside) - 3} more" if len(set_aside) > 3
                                                           else "") if set_aside else ""
    return (f"records_from={source}: {counts['taken']} finished arms taken" + (f"; left out: {left}" if left else "")
            + named)


def _run_each(arms: list[Arm], records: Path, describe: Callable[[dict], str], only: int | None) -> list[dict]:
    done = []
    for i, arm in enumerate(arms, 1):
        if only is not None and i - 1 != only:
            continue
        prefix = f"[{i:>{len(str(len(arms)))}}/{len(arms)}]"
        path = records / f"{arm.name}.json"
        stored = stored_record(path, arm.settings, arm.cap)
        if stored.state == "done":
            if stored.record["settings"] != json.loads(path.read_text())["settings"]:
                write_record(path, stored.record)  # kept under a raised cap: the record says the cap it holds for
            print(f"{prefix} {describe(stored.record)}  (done before)", flush=True)
            done.append(stored.record)
            continue
        note = rerun_note(stored, path)
        resume = (stored.state in ("interrupted", "extend") and arm.checkpoint is not None
                  and arm.checkpoint.is_file())
        if resume:
            note = (f"continuing from {arm.checkpoint}, where it was interrupted" if stored.state == "interrupted"
                    else f"continuing from {arm.checkpoint}: it ran to its cap, raised ({stored.changes[0]})")
        if note:
            print(f"{prefix} {arm.name}: {note}", flush=True)
        if not resume and arm.checkpoint is not None:
            # A run of other settings (or one a second Ctrl-C cut before it saved) must not be
            # continued later as if it were this arm's.
            arm.checkpoint.unlink(missing_ok=True)
        earlier = stored.record.get("seconds", 0.0) if resume else 0.0  # the interrupted part's time counts too
        done.append(_run_one(arm, path, prefix, resume, earlier, describe))
    return done


def interruption_within(e: BaseException) -> BaseException | None:
    """The stop a library wrapped in its own error (torch.compile's InductorError wraps a signal
    that arrived while it compiled), so that a stop is still one line, not a traceback."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, (Interrupted, KeyboardInterrupt)):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _run_one(arm: Arm, path: Path, prefix: str, resume: bool, earlier: float,
             describe: Callable[[dict], str]) -> dict:
    base = {"arm": arm.name, **arm.labels}
    settings = as_json_data(arm.settings)
    started = time.perf_counter() - earlier
    try:
        with signals_interrupt():
            try:
                figures = run_logged(arm, resume)
            except Exception as e:
                stop = interruption_within(e)
                if stop is None:
                    raise
                raise stop from None
    except (Interrupted, KeyboardInterrupt) as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        write_record(path, {**base, "interrupted": True, "seconds": time.perf_counter() - started,
                            "settings": settings})
        where = f"at step {e.step}" if isinstance(e, RunInterrupted) else "while it ran"
        kept = arm.checkpoint is not None and arm.checkpoint.is_file()
        then = f"the same command continues it from {arm.checkpoint}" if kept else "the same command runs it again"
        raise Interrupted(signum, f"{prefix} {arm.name} stopped by {signal.Signals(signum).name} {where}; "
                                  f"the arms before it are kept, and {then}") from None
    except Exception as e:
        seconds = time.perf_counter() - started
        write_record(path, {**base, "error": f"{type(e).__name__}: {one_line(e, 400)}", "seconds": seconds,
                            "settings": settings})
        print(f"{prefix} {arm.name} failed after {seconds:.0f} s: {one_line(e)}"
              + (f" (its log: {arm.log})" if arm.log else ""), flush=True)
        raise
    record = sealed(as_json_data({**base, **figures, "seconds": time.perf_counter() - started,
                                  "ran_on": {"host": platform.node(), "pid": os.getpid(), **machine()},
                                  "settings": settings}))
    write_record(path, record)
    print(f"{prefix} {describe(record)}  ({record['seconds']:.0f} s)", flush=True)
    return record


def machine() -> dict:
    """Where the figures were measured, for the results."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"cpu": cpu, "threads": torch.get_num_threads(), "gpu": gpu, "torch": torch.__version__}


def ran_on_machine(record: dict, here: dict) -> bool:
    """Whether the record was measured on a machine like `here` (the processor, the GPU, torch and
    the threads it used); a record from before records named their machine never is."""
    ran_on = record.get("ran_on")
    return isinstance(ran_on, dict) and all(ran_on.get(key, object()) == value for key, value in here.items())
