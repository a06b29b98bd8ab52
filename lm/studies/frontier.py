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

import itertools
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError

from lm.config.attn import PER_LAYER
from lm.config.compare import KNOB_MODEL_KEYS
from lm.data.recall_task import IGNORE, RecallTask
from lm.formats.checkpoint import load
from lm.model.generation_cache import GenerationCache
from lm.studies.compare_arms import Entry, _trainer, check_run, lr_tag, resumed, training_config
from lm.studies.compare_runs import training_figures, unless_diverged
from lm.studies.compare_tables import si_bytes
from lm.studies.engine import Arm, recorded_settings
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


def check_frontier(cfg: DictConfig) -> None:
    """What frontier.* says beyond each setting's own bound: every train and test cell fits the
    vocabulary and its sequence, and a test reaches beyond the trained length. The knob table may
    name kinds a study leaves out (a preset's table serves `kinds=[...]` subsets too); a kind it
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
                       "examples": examples, "val_examples": f.val_examples, "seed": seed,
                       "batch_size": f.batch_size, "filler": f.filler, "query_power": m.query_power},
              "optim": {"lr": lr, "warmup_steps": f.warmup_steps},
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


def frontier_arms(cfg: DictConfig, entry: Entry, seeds: list[int], common: dict, runs: Path) -> list[Arm]:
    """Per state size of the kind, one arm per learning rate and seed."""
    f = cfg.frontier
    tests = test_cells(f)
    arms = []
    for point, lr, seed in itertools.product(knob_points(f, entry.name), as_list("frontier.lr", f.lr), seeds):
        name = f"frontier-{entry.name}-{point_tag(point)}-{lr_tag(lr)}-s{seed}"
        try:  # a knob the kind does not take, or a size its model refuses, named as the table gives it
            run_cfg = point_config(cfg, entry, point, lr, seed, common, name)
            check_run(name, run_cfg, recall=True)
        except ConfigError as e:
            raise ConfigError(f"frontier.knobs.{entry.name} {point_label(point)}: {e}") from None
        except ConfigKeyError as e:  # a key the kind's attn schema lacks
            raise ConfigError(f"frontier.knobs.{entry.name} {point_label(point)}: {e.key} is not an option of "
                              f"{entry.name}'s attention") from None
        settings = {**recorded_settings(run_cfg), "tests": [list(t) for t in tests],
                    "test_examples": f.test_examples}
        arms.append(Arm(name, settings,
                        lambda resume=False, c=run_cfg: unless_diverged(
                            lambda r: frontier_run(r, tests, f.test_examples), resumed(c, resume)),
                        labels={"task": "frontier", "kind": entry.name, "point": point_label(point), "knobs": point,
                                "lr": lr, "seed": seed},
                        log=runs / name / "train.log", checkpoint=runs / name / "last.ckpt"))
    return arms


def frontier_run(run_cfg: DictConfig, tests: list[tuple[int, int]], examples: int) -> dict:
    """Train on the mix, then each test cell's accuracy and the state bytes at its length."""
    result = train(run_cfg)
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
