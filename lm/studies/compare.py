"""Which attention should I use? Every kind on recall, language modelling, speed and memory.

For each kind (an attn config such as `gqa`, a registered kind at its defaults, or an entry with
options), at equal steps and equal model size:

- MQAR (lm/data/mqar.py) accuracy on held-out examples for each model width x number of pairs;
- language modelling on the `data` corpus: validation loss against training time, then loss and
  bits per byte over the whole validation split (lm/evaluation/perplexity.py);
- training tokens/s of that run, and greedy decoding tokens/s and cache bytes at each context of
  `speed.contexts`, on a freshly initialised model of the same shape (speed does not depend on the
  weights, and the trained model's context may be shorter).

Every arm is an ordinary training run composed from conf/train.yaml, so the study measures what
`scripts/train.py` would do; lm/studies/engine.py runs the arms, keeps their records in
<out>/records/ and reuses those whose settings still match. Outputs: results.json, results.md,
mqar_accuracy.png, lm_loss.png under `out`.

This module is the study from end to end (`plan`, `run_study`); its parts: the settings
(compare_settings), the arms (compare_arms), what each arm measures (compare_runs), the tables
and plots (compare_tables, compare_plots).
"""

from __future__ import annotations

import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lm.attention import available_kinds
from lm.config.compare import CompareRun
from lm.config.compose import forget_changed_compositions
from lm.data.corpora import build_corpus
from lm.evaluation.perplexity import split_documents
from lm.studies.compare_arms import (
    BASES,
    attn_configs,
    language_arms,
    preset_kinds,
    recall_arms,
    speed_arm,
    study_entries,
)
from lm.studies.compare_plots import lm_loss_plot, mqar_plot
from lm.studies.compare_runs import unless_diverged
from lm.studies.compare_settings import check_per_kind, check_study_settings, for_kind, study_seeds, study_tasks
from lm.studies.compare_tables import comparison_table
from lm.studies.engine import Arm, finished_records, import_records, machine, run_arms
from lm.studies.frontier import check_frontier, check_knob_kinds, describe_frontier, frontier_arms
from lm.studies.frontier_report import frontier_plot, frontier_tables
from lm.studies.jobs import check_launcher, chosen_launcher, only_arm, run_as_jobs
from lm.studies.report import write_results
from lm.util.checks import as_list
from lm.util.errors import DataError
from lm.util.paths import resolve_path

# The study's rule that a diverged run is a result of the sweep, named with the study it serves.
__all__ = ["plan", "run_study", "corpus_key", "describe", "unless_diverged"]


def corpus_key(cfg: DictConfig) -> str:
    """The corpus's content fingerprint (file sizes and modification times, or the dataset's
    identity), checked to leave the evaluation some text: the language-modelling records are keyed
    by it, so rewritten files rerun the arms they feed."""
    corpus = build_corpus(cfg.data)
    val_fraction = cfg.data.val_fraction
    if not any(text.strip() for text in split_documents(corpus, "val", float(val_fraction))):
        raise DataError(f"data.val_fraction={val_fraction} leaves no document of the corpus for validation and "
                        "evaluation: give more documents or a larger fraction")
    return corpus.fingerprint


def plan(study: CompareRun) -> list[Arm]:
    """Every arm of the study, each checked before any training starts: per kind, the recall
    cells (width x pairs) at each swept learning rate and seed, the language-modelling runs at each
    learning rate and seed, and one speed arm."""
    if not isinstance(study, CompareRun):
        raise TypeError(f"plan() takes a CompareRun (lm.config.compare), not {type(study).__name__}: build one "
                        "from a composed config with CompareRun.from_config(cfg)")
    cfg = study.as_config()  # each kind's per_kind merges onto it as the command line would
    check_study_settings(cfg)
    # the config files may have changed since the last plan of this process: what they changed composes again
    forget_changed_compositions()
    BASES.clear()
    entries = study_entries(cfg)
    known = sorted({*attn_configs(), *available_kinds(), *preset_kinds(), *(e.name for e in entries)})
    check_per_kind(cfg, known)
    check_knob_kinds(cfg, known)
    tasks = study_tasks(cfg)
    if "frontier" in tasks:
        check_frontier(cfg)
    runs = resolve_path(cfg.out) / "runs"
    common = {"checkpoint_dir": str(runs), "resume": False, "checkpoint": {"every_n_steps": None},
              "sample": {"max_new_tokens": 0}}
    fingerprint = corpus_key(cfg) if "lm" in tasks else None
    arms = []
    for entry in entries:
        own = for_kind(cfg, entry.name)
        seeds = study_seeds(own)
        if "mqar" in tasks:
            arms += recall_arms(own, entry, seeds, common, runs)
        if "lm" in tasks:
            arms += language_arms(own, entry, seeds, common, runs, fingerprint)
        if "speed" in tasks:
            arms.append(speed_arm(own, entry, common))
        if "frontier" in tasks:
            arms += frontier_arms(own, entry, seeds, common, runs, resolve_path(cfg.out) / "records")
    return arms


def describe(r: dict) -> str:
    if r["task"] == "frontier":
        return describe_frontier(r)
    if "diverged" in r:
        return f"{r['task']:<5} {r['kind']:<14} lr={r['lr']:<7g} seed={r['seed']:<2} diverged"
    if r["task"] == "mqar":
        return (f"mqar  {r['kind']:<14} d={r['width']:<4} pairs={r['pairs']:<3} lr={r['lr']:<7g} seed={r['seed']:<2} "
                f"accuracy {r['val_accuracy']:.3f} after {r['steps']} steps")
    if r["task"] == "lm":
        return (f"lm    {r['kind']:<14} lr={r['lr']:<7g} seed={r['seed']:<2} val loss {r['eval_loss']:.3f}, "
                f"{r['bits_per_byte']:.3f} bits/byte, train {r['train_tokens_per_s']:.0f} tok/s")
    speeds = ", ".join(f"{d['tokens_per_s']:.0f} tok/s at {d['context']} x {d.get('batch', 1)}" for d in r["decode"])
    training = ", ".join(f"{t['tokens_per_s']:.0f} tok/s at {t['context']}" for t in r.get("train", []))
    return f"speed {r['kind']:<14} decode {speeds}" + (f"; train {training}" if training else "")


def table_entry(labels: dict) -> tuple:
    """The entry of the tables an arm counts towards: a recall cell (every rate and seed of one
    width x pairs), a kind's language modelling (every rate and seed), a kind's speed, a kind's
    state size on the frontier (every rate and seed)."""
    return labels["task"], labels["kind"], labels.get("width"), labels.get("pairs"), labels.get("point")


def reported_records(arms: list[Arm], records: Path) -> tuple[list[dict], list[dict], list[str]]:
    """`report_only=true`: the finished records of the entries whose every arm has finished, those of
    the entries still waiting for an arm, and the names of the arms not finished. An entry with an
    arm missing is left out of the tables whole: a best rate chosen among the rates that happen to
    have run, or a mean over one seed of two, would be a number the finished study might not show."""
    done, unfinished = finished_records(arms, records)
    incomplete = {table_entry(arm.labels) for arm in unfinished}
    shown = [r for r in done if table_entry(r) not in incomplete]
    waiting = [r for r in done if table_entry(r) in incomplete]
    if unfinished:
        print(f"report_only: {len(done)} of {len(arms)} arms have finished; {len(incomplete)} table entries wait for "
              f"the other {len(unfinished)} and are left out (results.json names them)", flush=True)
    else:
        print(f"report_only: all {len(arms)} arms have finished", flush=True)
    return shown, waiting, [arm.name for arm in unfinished]


def run_study(study: CompareRun) -> dict | None:
    """What scripts/compare.py runs: every arm (reusing finished ones; as jobs of the chosen Hydra
    launcher, lm.studies.jobs), then the outputs. `arm=<i>` runs that arm alone, as a job does,
    and writes no report (None); `report_only=true` runs no arm and reports the finished ones."""
    started = time.perf_counter()
    launcher = chosen_launcher()
    if launcher is not None:
        check_launcher(launcher)
    arms = plan(study)
    cfg = study.as_config()
    out = resolve_path(cfg.out)
    if cfg.arm is not None:
        run_arms(arms, out / "records", describe, only=only_arm(arms, cfg.arm))
        return None
    if cfg.records_from is not None:  # before any job starts: the jobs then find the records done
        print(import_records(arms, out / "records", resolve_path(cfg.records_from),
                             times_this_machine=lambda arm: arm.labels["task"] == "speed"), flush=True)
    unfinished = waiting = None
    if cfg.report_only:
        records, waiting, unfinished = reported_records(arms, out / "records")
    else:
        if launcher is not None:
            run_as_jobs(arms, out / "records", launcher)
        records = run_arms(arms, out / "records", describe)
    settings = OmegaConf.to_container(cfg, resolve=True)
    for key in ("contexts", "batches", "train_contexts"):  # each a list, also where one value was typed
        settings["speed"][key] = as_list(f"speed.{key}", settings["speed"][key])
    results = {"machine": machine(), "seconds": round(time.perf_counter() - started, 1),
               "settings": settings, "records": records}
    if unfinished:  # report_only with arms left to run (once all have, the report is the finished study's);
        # the finished arms of waiting entries are kept too, so records_from can continue from this file
        results["unfinished"] = {"planned": len(arms), "arms": unfinished}
        results["waiting"] = waiting
    still_learning, plateau = cfg.frontier.still_learning, cfg.frontier.plateau
    frontier = frontier_tables(records, results["settings"])
    table = comparison_table(results) + ("\n" + "\n".join(frontier) if frontier else "")
    write_results(out, results, table,
                  {"mqar_accuracy.png": mqar_plot, "lm_loss.png": lm_loss_plot,
                   "frontier.png": lambda records: frontier_plot(records, still_learning, plateau)})
    return results
