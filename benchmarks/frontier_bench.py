"""`scripts/bench.py frontier`: what one arm of the recall-memory frontier costs, per kind and state
size: CPU seconds per training step, one thread, through the study's own path (the arm's run config
from `preset=frontier`, trained by `lm.training.run.train` with Lightning, its data and its loss).

Each point trains twice in this process, `--warmup` steps and `--warmup + --steps` steps on the
same data, validating once at the end of each; the difference of the two runs' process CPU time
over `--steps` is the cost of a step, and what the short run spent beyond its steps is the arm's
fixed cost (start-up, data, one validation, the checkpoint). A step of a mix draws its batch from
one cell or pads every cell to the longest, as the code under test does: the steps measured are the
same batches in both runs, so only their number differs.

CPU time, not wall-clock: another job on the machine slows a step's wall-clock but not the CPU
seconds it spends, so two versions of the code can be measured side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time

import torch
from hydra import initialize_config_dir

from lm.config.compose import CONF_DIR, composed
from lm.config.train import TrainRun
from lm.studies.compare_arms import study_entries
from lm.studies.compare_settings import for_kind
from lm.studies.engine import quiet_lightning
from lm.studies.frontier import knob_points, point_config, point_label
from lm.training.run import train

TABLE_KINDS = ("mha", "sliding", "linear", "gated_delta", "kda", "mamba2", "mla", "dsa")


def trained_cpu_seconds(run_cfg, steps: int, folder: str) -> float:
    """Process CPU seconds of one train() of `steps` steps, validating once at its end."""
    run_cfg.trainer.max_steps = steps
    run_cfg.trainer.val_every_n_steps = steps
    run_cfg.trainer.stop_at_accuracy = None
    run_cfg.run_name = f"steps{steps}"
    run_cfg.checkpoint_dir = folder
    started = time.process_time()
    with quiet_lightning(), contextlib.redirect_stdout(io.StringIO()):
        train(TrainRun.from_config(run_cfg))
    return time.process_time() - started


def kind_rows(cfg, entry, args: argparse.Namespace) -> list[dict]:
    """Each of the kind's points (or its middle one): CPU seconds per step and the arm's fixed cost."""
    own = for_kind(cfg, entry.name)
    points = knob_points(own.frontier, entry.name)
    rows = []
    for point in points if args.points == "all" else points[len(points) // 2:len(points) // 2 + 1]:
        run_cfg = point_config(own, entry, point, float(own.frontier.lr[-1]), 0, {"resume": False,
                               "checkpoint": {"every_n_steps": None}, "sample": {"max_new_tokens": 0}}, "bench")
        run_cfg.data.examples = (args.warmup + args.steps) * run_cfg.data.batch_size  # the same data in both
        with tempfile.TemporaryDirectory() as folder:
            short = trained_cpu_seconds(run_cfg, args.warmup, folder)
            long = trained_cpu_seconds(run_cfg, args.warmup + args.steps, folder)
        per_step = (long - short) / args.steps
        fixed = short - args.warmup * per_step
        rows.append({"kind": entry.name, "point": point, "cpu_s_per_step": per_step, "fixed_cpu_s": fixed})
        print(f"{entry.name:<12} {point_label(point):<14} {per_step:>10.3f} {fixed:>11.1f}", flush=True)
    return rows


def bench_frontier(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    kinds = args.kinds.split(",")
    with initialize_config_dir(str(CONF_DIR), version_base=None):  # the arms compose conf/train.yaml
        cfg = composed("compare", ("preset=frontier", f"kinds=[{','.join(kinds)}]", "extra_kinds=[]",
                                   *args.override))
        print(f"{'kind':<12} {'point':<14} {'CPU s/step':>10} {'fixed CPU s':>11}")
        rows = [row for entry in study_entries(cfg) for row in kind_rows(cfg, entry, args)]
    return {"rows": rows}


def add_frontier_parser(sub, count) -> argparse.ArgumentParser:
    """Its subcommand; `count` is bench.py's argparse type of a count of at least 1."""
    frontier = sub.add_parser("frontier", help="CPU seconds per training step of the frontier's arms, one thread")
    frontier.add_argument("--kinds", default=",".join(TABLE_KINDS), help="comma-separated kinds of the preset")
    frontier.add_argument("--points", choices=("middle", "all"), default="all",
                          help="every state size of a kind, or its middle one")
    frontier.add_argument("--steps", type=count, default=40, help="measured steps per point")
    frontier.add_argument("--warmup", type=count, default=10, help="steps of the shorter run")
    frontier.add_argument("override", nargs="*", help="compare.py settings on top of preset=frontier")
    frontier.set_defaults(run=bench_frontier)
    return frontier
