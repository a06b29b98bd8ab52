"""The recall-memory frontier (Based's Figure 2, Arora et al. 2024): MQAR accuracy against the bytes a
model holds to decode, for every kind at several state sizes along its own knob.

Each arm is an ordinary training run (conf/train.yaml, `data.mix`: every [seq_len, pairs] of
`frontier.train` at once), then tests at each cell of `frontier.test` on fresh held-out examples,
and at each test length the bytes of the model's own generation cache for one sequence of that
length (lm.model.generation_cache.GenerationCache.nbytes: what every layer's cache and short
convolution declare they hold), never a formula here: a kind's cache is the only authority on its
state. A kind's knob comes from `frontier.knobs` (a kind it does not name sweeps the width,
`frontier.widths`), so a kind registered later joins with one line in that table, or none.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError

from lm.config.attn import PER_LAYER
from lm.config.compare import KNOB_MODEL_KEYS
from lm.config.train import TrainRun
from lm.data.recall_task import IGNORE, RecallTask
from lm.formats.checkpoint import load
from lm.model.generation_cache import GenerationCache
from lm.studies.compare_arms import Entry, _trainer, check_run, lr_tag, resumed, training_config
from lm.studies.compare_runs import training_figures, unless_diverged
from lm.studies.compare_tables import diverged, si_bytes
from lm.studies.engine import Arm, StepCap, finished_records, recorded_settings
from lm.studies.frontier_report import best_rate, mix_accuracy, ran_every_step
from lm.training.run import train
from lm.util.checks import as_list
from lm.util.errors import ConfigError

TEST_BATCH = 64  # examples per forward pass of a test: memory, not a result


def knob_points(f: DictConfig, name: str) -> list[dict]:
    """The kind's state sizes, each {knob: value}: its frontier.knobs entry, or {width: w} for each
    of frontier.widths."""
    table = f.knobs.get(name) if f.knobs is not None else None
    if table is None:
        return [{"width": w} for w in as_list("frontier.widths", f.widths)]
    return [OmegaConf.to_container(point, resolve=True) for point in table]


def point_tag(point: dict) -> str:
    """A point as a file name's part: width64, n_layer4-width32, feature_maptaylor."""
    return "-".join(f"{k}{v}" for k, v in point.items())


def point_label(point: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in point.items())


def test_cells(f: DictConfig) -> list[tuple[int, int]]:
    return [(int(s), int(p)) for s, p in f.test]


def check_knob_kinds(cfg: DictConfig, known: list[str]) -> None:
    """The knob table may name kinds a study leaves out (a preset's table serves `kinds=[...]` subsets
    too) but only kinds it could compare (`known`, as per_kind's), whatever the tasks: a misspelt one
    would be ignored while its kind swept the width."""
    for name in cfg.frontier.knobs or {}:
        if name not in known:
            raise ConfigError(f"frontier.knobs.{name} names no kind this study could compare; the kinds are "
                              f"{', '.join(sorted(known))}")


def check_frontier(cfg: DictConfig) -> None:
    """What frontier.* says beyond each setting's own bound: every train and test cell fits the
    vocabulary and its sequence, and a test reaches beyond the trained length. A kind the knob table
    does not name sweeps the width, which its points' labels (width=...) show."""
    f = cfg.frontier
    for key in ("train", "test"):
        for seq_len, pairs in f[key]:
            try:
                RecallTask(vocab_size=f.vocab_size, seq_len=seq_len, pairs=pairs, examples=1, val_examples=1)
            except ValueError as e:
                raise ConfigError(f"frontier.{key} entry [{seq_len}, {pairs}]: {e}") from None
    if f.block == "based" and f.short_conv < 2:
        raise ConfigError(f"frontier.short_conv={f.short_conv} leaves Based's block no convolution: its gated "
                          "convolution needs at least 2 taps (frontier.block=transformer runs without one)")
    if f.train_examples is not None and len(f.train_examples) != len(f.train):
        raise ConfigError(f"frontier.train_examples={list(f.train_examples)} gives {len(f.train_examples)} counts for "
                          f"the {len(f.train)} cells of frontier.train: one per cell, in its order")
    if f.schedule == "constant" and f.steps % f.val_every:
        raise ConfigError(f"frontier.steps={f.steps} is not a multiple of frontier.val_every={f.val_every}: an "
                          "arm that ran to its cap continues from the checkpoint of its last validation, so the cap "
                          "must fall on one")
    if f.schedule == "constant" and f.examples is None and f.train_examples is None:
        raise ConfigError("frontier.examples=null makes the examples frontier.steps x batch_size, so a raised cap "
                          "would train on other examples than the arms it continues: give a count with "
                          "frontier.schedule=constant")
    trained = max(s for s, _ in f.train)
    if not any(s > trained for s, _ in f.test):
        raise ConfigError(f"frontier.test={OmegaConf.to_container(f.test)} has no sequence longer than the "
                          f"longest trained ({trained}): the frontier tests recall beyond the trained length")


def point_config(cfg: DictConfig, entry: Entry, point: dict, lr: float, seed: int, common: dict,
                 name: str) -> DictConfig:
    """The arm's run config: the frontier's recipe, the point's knobs on top (model sizes, K/V heads,
    attn options), the model's context long enough for the longest test."""
    f, m = cfg.frontier, cfg.mqar
    sizes = {"width": f.width, "n_layer": f.n_layer, "n_head": f.n_head}
    sizes.update({k: v for k, v in point.items() if k in KNOB_MODEL_KEYS})
    attn = {k: v for k, v in point.items() if k not in KNOB_MODEL_KEYS}
    train_cells = [[int(s), int(p)] for s, p in f.train]
    longest = max(train_cells)
    examples = f.examples or f.steps * f.batch_size
    values = {**common, "seed": seed, "run_name": name,
              "model": {"name": f"frontier-d{sizes['width']}", "n_layer": sizes["n_layer"], "d_model": sizes["width"],
                        "n_head": sizes["n_head"], "d_ff": f.ff_mult * sizes["width"],
                        "max_seq_len": max([s for s, _ in train_cells] + [s for s, _ in test_cells(f)]),
                        "short_conv": f.short_conv},
              # seq_len and pairs name the mix's longest cell; data.mix is what trains
              "data": {"vocab_size": f.vocab_size, "seq_len": longest[0], "pairs": longest[1], "mix": train_cells,
                       "mix_examples": None if f.train_examples is None else [int(n) for n in f.train_examples],
                       # where the cells hold their own counts, data.examples is their total (the mix reads the counts)
                       "examples": examples if f.train_examples is None else sum(f.train_examples),
                       "val_examples": f.val_examples, "seed": seed,
                       "batch_size": f.batch_size, "filler": f.filler, "query_power": m.query_power},
              "optim": {"lr": lr, "warmup_steps": f.warmup_steps, "schedule": f.schedule},
              "trainer": {**_trainer(f.steps, f.val_every, None), "stop_at_accuracy": f.stop_at_accuracy}}
    with_knobs = Entry(entry.name, entry.attn, entry.kind, {**entry.options, **attn})
    run_cfg = training_config(with_knobs, ["data=mqar"], values)
    if f.block != "based":
        return run_cfg
    return training_config(based_block(run_cfg.attn, f.short_conv), ["data=mqar"],
                           {**values, "model": {**values["model"], "n_layer": 2 * sizes["n_layer"], "mlp": "none",
                                                "short_conv": 0}})


def based_block(attn: DictConfig, taps: int) -> Entry:
    """The arm's attention as Based's block lays it out (zoology's Hybrid of [BaseConv, mixer] and no
    MLP): a gated short convolution layer (attn=baseconv) before each of its mixer layers, in a
    hybrid of twice the layers that keeps every option of the kind's own layers."""
    options = OmegaConf.to_container(attn, resolve=True)
    name, kind, pattern = options.pop("name"), options.pop("kind", None), options.pop("pattern", None)
    mixers = pattern if kind is None else [kind]  # a hybrid's attn config names its layers' kinds, no kind
    options = {key: value for key, value in options.items() if value is not None}
    return Entry(name, PER_LAYER, None, {**options, "pattern": [k for mixer in mixers for k in ("baseconv", mixer)],
                                         "taps": taps})


def frontier_arms(cfg: DictConfig, entry: Entry, seeds: list[int], common: dict, runs: Path,
                  records: Path) -> list[Arm]:
    """The kind's arms: every rate at every point on every seed (`frontier.rates_at=grid`), or as far
    as its finished records decide them:
    - the rate search, on the first seed: the whole frontier.lr grid at every state size (`every`),
      or at the middle one (`middle`) and, once that has finished, the best rate there with its
      neighbours on the grid at the others; where a point's best rate is at an edge of the rates it
      ran (and it left the plateau), one step further that way;
    - once a point's search has finished, its best rate on the other seeds.
    So a command plans what the records so far call for, and the same command again plans the next."""
    f = cfg.frontier
    points, first = knob_points(f, entry.name), seeds[0]
    ladder = RateLadder(as_list("frontier.lr", f.lr))

    def arm(point: dict, lr: float, seed: int) -> Arm:
        return frontier_arm(cfg, entry, point, lr, seed, common, runs)

    if f.rates_at == "grid":
        return [arm(point, lr, seed) for point in points for lr in as_list("frontier.lr", f.lr) for seed in seeds]

    searched = points if f.rates_at == "every" else [points[len(points) // 2]]
    arms, best = [], {}
    for point in searched:
        search, best[point_tag(point)] = rate_search(ladder, ladder.grid, lambda lr, p=point: arm(p, lr, first),
                                                     records, f.plateau)
        arms += search
    middle = best[point_tag(searched[0])] if f.rates_at == "middle" else None
    for point in points:
        if point in searched:
            continue
        if middle is None:
            break  # the middle point's search decides these rates: planned once it has finished
        search, best[point_tag(point)] = rate_search(ladder, ladder.around(middle),
                                                     lambda lr, p=point: arm(p, lr, first), records, f.plateau)
        arms += search
    for point in points:  # the other seeds, where the rate is known
        lr = best.get(point_tag(point))
        if lr is not None:
            arms += [arm(point, lr, seed) for seed in seeds[1:]]
    return arms


class RateLadder:
    """The learning rates a search may try: the frontier.lr grid and, one log-spaced step (the grid's
    own ratio) at a time, beyond its ends, each rate there given to 2 significant digits."""

    def __init__(self, grid: list[float]):
        self.grid = sorted(float(lr) for lr in grid)
        self.ratio = (self.grid[-1] / self.grid[0]) ** (1 / (len(self.grid) - 1)) if len(self.grid) > 1 else None

    def step(self, lr: float, direction: int) -> float | None:
        """The next rate from `lr` up (+1) or down (-1): on the grid, or past it; None without a ratio."""
        if self.ratio is None:
            return None
        if lr in self.grid and 0 <= self.grid.index(lr) + direction < len(self.grid):
            return self.grid[self.grid.index(lr) + direction]
        step = lr * self.ratio ** direction
        # back onto the grid where the step lands on it (0.1 down is 0.0316, not 0.032)
        return next((g for g in self.grid if abs(g - step) <= 0.02 * g), float(f"{step:.2g}"))

    def around(self, lr: float) -> list[float]:
        """`lr` and its neighbours."""
        return sorted({lr, *(r for r in (self.step(lr, -1), self.step(lr, 1)) if r is not None)})


def rate_search(ladder: RateLadder, rates: list[float], arm_at, records: Path,
                plateau: float) -> tuple[list[Arm], float | None]:
    """The arms of one point's rate search and its best rate (None until they have all finished):
    `rates`, and one step past the edge where the best of them is, unless it is on the plateau; where
    every rate diverged, one step below the lowest."""
    arms = {lr: arm_at(lr) for lr in rates}
    best = best_finished(arms, records)
    if best is None:
        return list(arms.values()), None
    lr, accuracy, all_diverged = best
    if all_diverged:
        beyond = ladder.step(min(rates), -1)
    elif lr in (min(rates), max(rates)) and accuracy > plateau:
        beyond = ladder.step(lr, -1 if lr == min(rates) else 1)
    else:
        beyond = None
    if beyond is not None and beyond not in arms:
        arms[beyond] = arm_at(beyond)
        best = best_finished(arms, records)
    return list(arms.values()), None if best is None else best[0]


def best_finished(arms: dict[float, Arm], records: Path) -> tuple[float, float, bool] | None:
    """(rate, accuracy on the mix, whether every rate diverged) of the best of the rates' arms, once
    every one has finished."""
    done, unfinished = finished_records(list(arms.values()), records)
    if unfinished:
        return None
    by_lr = {r["lr"]: [r] for r in done}
    lr = best_rate(by_lr)
    return lr, mix_accuracy(by_lr[lr][0]), all(diverged(r) for r in done)


def frontier_arm(cfg: DictConfig, entry: Entry, point: dict, lr: float, seed: int, common: dict, runs: Path) -> Arm:
    """One point at one rate and seed. Under a constant rate its step cap (frontier.steps) can be
    raised: the arms that ran to the old one continue from their checkpoints (lm.studies.engine)."""
    f = cfg.frontier
    tests = test_cells(f)
    name = f"frontier-{entry.name}-{point_tag(point)}-{lr_tag(lr)}-s{seed}"
    try:  # a knob the kind does not take, or a size its model refuses, named as the table gives it
        run_cfg = point_config(cfg, entry, point, lr, seed, common, name)
        check_run(name, run_cfg, recall=True)
    except ConfigError as e:
        raise ConfigError(f"frontier.knobs.{entry.name} {point_label(point)}: {e}") from None
    except ConfigKeyError as e:  # a key the kind's attn schema lacks
        raise ConfigError(f"frontier.knobs.{entry.name} {point_label(point)}: {e.key} is not an option of "
                          f"{entry.name}'s attention") from None
    settings = {**recorded_settings(run_cfg), "tests": [list(t) for t in tests], "test_examples": f.test_examples}
    return Arm(name, settings,
               lambda resume=False: unless_diverged(lambda r: frontier_run(r, tests, f.test_examples),
                                                    resumed(run_cfg, resume)),
               labels={"task": "frontier", "kind": entry.name, "point": point_label(point), "knobs": point,
                       "lr": lr, "seed": seed},
               log=runs / name / "train.log", checkpoint=runs / name / "last.ckpt",
               cap=StepCap("trainer.max_steps", ran_every_step) if f.schedule == "constant" else None)


def frontier_run(run_cfg: DictConfig, tests: list[tuple[int, int]], examples: int) -> dict:
    """Train on the mix, then each test cell's accuracy and the state bytes at its length."""
    result = train(TrainRun.from_config(run_cfg))
    model, _ = load(result["last"])
    d = run_cfg.data
    measured = []
    for seq_len, pairs in tests:
        task = RecallTask(vocab_size=d.vocab_size, seq_len=seq_len, pairs=pairs, examples=1, val_examples=examples,
                          seed=d.seed, filler=d.filler, query_power=d.query_power)
        measured.append({"seq_len": seq_len, "pairs": pairs, "accuracy": recall_accuracy(model, task),
                         "state_bytes": state_bytes(model, seq_len)})
    return {**training_figures(result), "tests": measured}


@torch.no_grad()
def recall_accuracy(model, task: RecallTask) -> float:
    """The fraction of the task's test answers the model's arg-max gets right: the "test" split, which
    neither training nor the validation that chose the learning rate and stopped early has seen."""
    inputs, targets = (torch.from_numpy(a) for a in task.generate("test"))
    model.eval()
    correct = answered = 0
    for start in range(0, len(inputs), TEST_BATCH):
        x, y = inputs[start:start + TEST_BATCH], targets[start:start + TEST_BATCH]  # (B, T) each
        scored = y != IGNORE
        correct += int((model(x).argmax(-1) == y)[scored].sum())
        answered += int(scored.sum())
    return correct / answered


def state_bytes(model, seq_len: int) -> int:
    """Bytes of the generation cache the model builds for one sequence of seq_len tokens: every
    layer's cache and short convolution, as each declares its tensors."""
    cache = GenerationCache(model, pad=torch.zeros(1, dtype=torch.long), max_len=seq_len)
    return cache.nbytes()


def describe_frontier(r: dict) -> str:
    """The terminal's one line of a frontier arm."""
    head = f"front {r['kind']:<18} {r['point']:<22} lr={r['lr']:<7g} seed={r['seed']:<2}"
    if "diverged" in r:
        return head + " diverged"
    tests = " ".join(f"{t['accuracy']:.2f}" for t in r["tests"])
    low, high = min(t["state_bytes"] for t in r["tests"]), max(t["state_bytes"] for t in r["tests"])
    state = si_bytes(low) if low == high else f"{si_bytes(low)}-{si_bytes(high)}"
    return f"{head} mix {r['val_accuracy']:.3f} after {r['steps']} steps; tests {tests}; state {state}"
