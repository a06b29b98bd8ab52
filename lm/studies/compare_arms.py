"""The attention comparison's arms: the kinds it compares (`kinds`, `extra_kinds`), each arm an
ordinary training run composed from conf/train.yaml with the study's settings, checked before any
arm trains: the recall cells (width x pairs) at each learning rate and seed, the language-modelling
runs at each learning rate and seed, and one speed arm per kind."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from lm.attention import available_kinds, spec_class
from lm.config.compose import composed, search_path
from lm.config.train import ADAMW_RECIPE, TrainRun
from lm.data.recall_task import RecallTask, mix_tasks
from lm.studies.compare_runs import language_run, recall_run, speed_figures, unless_diverged
from lm.studies.compare_settings import recall_lengths, speed_settings
from lm.studies.engine import Arm, recorded_settings
from lm.training.settings import model_config_from
from lm.util.checks import as_list
from lm.util.errors import ConfigError

PEERS = ["mha", "mqa", "gqa"]  # the softmax kind at three K/V head counts


@dataclass
class Entry:
    """One kind of the study: a name for the tables, the attn config it starts from, options on top."""

    name: str
    attn: str | None  # conf/attn/<attn>.yaml, or None for a registered kind without one
    kind: str | None  # the registered kind when attn is None
    options: dict


def attn_configs() -> list[str]:
    return sorted(GlobalHydra.instance().config_loader().get_group_options("attn"))


def preset_kinds() -> list[str]:
    """The names of the extra kinds the presets define (preset/*.yaml of the config folders Hydra searches,
    the first of a name as Hydra takes it): a preset's knob table and per_kind name them, and stay valid in
    a study that leaves them out (`extra_kinds=[]`)."""
    folders = [Path(path) for _, path in search_path() if "://" not in path]  # folders: lm's packages hold no preset
    names = set()
    for option in GlobalHydra.instance().config_loader().get_group_options("preset"):
        path = next((p for p in (f / "preset" / f"{option}.yaml" for f in folders) if p.is_file()), None)
        extra = OmegaConf.load(path).get("extra_kinds") if path is not None else None
        names |= {entry.get("name") for entry in extra or [] if hasattr(entry, "get")}
    return sorted(n for n in names if isinstance(n, str))


def study_entries(cfg: DictConfig) -> list[Entry]:
    """The kinds to compare: `kinds` (null: MHA, MQA, GQA, then every other registered kind at its
    defaults but those that only go beside a mixer, AttentionSpec.compared_alone) followed by
    `extra_kinds`. A kind registered later joins without an edit here."""
    configs = attn_configs()
    default = PEERS + [k for k in available_kinds() if k != "softmax" and spec_class(k).compared_alone]
    names = as_list("kinds", cfg.kinds) if cfg.kinds is not None else default
    entries = [_entry(name, {}, configs) for name in names]
    for extra in as_list("extra_kinds", cfg.extra_kinds):
        if not isinstance(extra, (str, DictConfig)):
            raise ConfigError(f"extra_kinds entry {extra!r} must be a kind's name or "
                              "{name: ..., attn: ..., option: ...}")
        extra = OmegaConf.to_container(extra, resolve=True) if not isinstance(extra, str) else {"attn": extra}
        base = extra.pop("attn", None)
        name = extra.pop("name", None) or base
        if base is None:
            raise ConfigError(f"extra_kinds entry {extra!r} needs attn: <an attn config or a kind>")
        entries.append(_entry(base, extra, configs, name=name))
    if not entries:
        raise ConfigError("kinds=[] and extra_kinds=[] leave nothing to compare: name at least one kind, "
                          "or kinds=null for every registered one")
    seen = [e.name for e in entries]
    duplicates = sorted({n for n in seen if seen.count(n) > 1})
    if duplicates:
        raise ConfigError(f"kinds names {duplicates} more than once")
    return entries


def _entry(base: str, options: dict, configs: list[str], name: str | None = None) -> Entry:
    if not isinstance(base, str):
        raise ConfigError(f"kinds entry {base!r} must be the name of an attn config or a registered kind")
    if name is not None and (not isinstance(name, str) or not name or any(c in name for c in '/\\:') or
                             name.startswith(".")):
        # The name becomes file names (records/lm-<name>.json, runs/lm-<name>/): one plain file name.
        raise ConfigError(f"extra_kinds name {name!r} must be a plain file name: no '/', '\\' or ':', "
                          "not starting with '.'")
    if base in configs:
        return Entry(name or base, base, None, options)
    if base in available_kinds():
        return Entry(name or base, None, base, options)
    raise ConfigError(f"kinds entry {base!r} is neither an attn config ({', '.join(configs)}) "
                      f"nor a registered kind ({', '.join(available_kinds())})")


# (search path, overrides, kind, data) -> conf/train.yaml composed with them (lm.config.compose.composed), the
# entry's kind and data in place: one plan's, cleared as the next starts
BASES: dict[tuple, DictConfig] = {}


def training_config(entry: Entry, task_overrides: list[str], values: dict, data: dict | None = None) -> DictConfig:
    """conf/train.yaml with this entry's attention and the study's settings (`data` replaces the
    data group whole). Hydra composes it once per attention config and task within a plan, and the
    entry's kind and data replace their groups once (a grid has hundreds of arms); each arm is one
    merge onto that, which copies it."""
    # the studies' recipe, not train.py's defaults: an arm's settings, and so its record, stay put
    overrides = (*ADAMW_RECIPE, f"attn={entry.attn}" if entry.attn else "attn=mha", "logger=none", *task_overrides)
    key = (search_path(), overrides, entry.kind, repr(data))
    if key not in BASES:
        base = OmegaConf.merge(composed("train", overrides))  # a copy: the replacements below stay this key's
        if entry.attn is None:  # a registered kind without a YAML: its spec's defaults, every head its own K/V
            base.attn = OmegaConf.create({"name": entry.kind, "kind": entry.kind, "n_kv_head": None})
        if data is not None:
            base.data = OmegaConf.create(data)
        BASES[key] = base
    return OmegaConf.merge(BASES[key], values, {"attn": entry.options})


def lr_tag(lr: float) -> str:
    return f"lr{lr:g}"


def recall_arms(cfg: DictConfig, entry: Entry, seeds: list[int], common: dict, runs: Path) -> list[Arm]:
    m = cfg.mqar
    # Fresh examples at every step unless a count is given: no run sees an example twice before
    # it could have solved the task (a model memorises a small set and stays on the plateau).
    examples = m.examples or m.steps * m.batch_size
    lengths = recall_lengths(m)
    arms = []
    for width, pairs, lr, seed in itertools.product(as_list("mqar.widths", m.widths), as_list("mqar.pairs", m.pairs),
                                                    as_list("mqar.lr", m.lr), seeds):
        name = f"mqar-{entry.name}-d{width}-p{pairs}-{lr_tag(lr)}-s{seed}"
        values = {**common, "seed": seed, "run_name": name,
                  "model": {"name": f"mqar-d{width}", "n_layer": m.n_layer, "d_model": width, "n_head": m.n_head,
                            "d_ff": m.ff_mult * width, "max_seq_len": lengths[pairs],
                            "short_conv": m.short_conv},
                  "data": {"vocab_size": m.vocab_size, "seq_len": lengths[pairs], "pairs": pairs, "examples": examples,
                           "val_examples": m.val_examples, "seed": seed, "batch_size": m.batch_size,
                           "filler": m.filler, "query_power": m.query_power},
                  "optim": {"lr": lr, "warmup_steps": m.warmup_steps},
                  "trainer": {**_trainer(m.steps, m.val_every, None), "stop_at_accuracy": m.stop_at_accuracy}}
        run_cfg = training_config(entry, ["data=mqar"], values)
        check_run(name, run_cfg, recall=True)
        arms.append(Arm(name, recorded_settings(run_cfg),
                        lambda resume=False, c=run_cfg: unless_diverged(recall_run, resumed(c, resume)),
                        labels={"task": "mqar", "kind": entry.name, "width": width, "pairs": pairs, "lr": lr,
                                "seed": seed},
                        log=runs / name / "train.log", checkpoint=runs / name / "last.ckpt"))
    return arms


def language_config(cfg: DictConfig, entry: Entry, lr: float, seed: int, common: dict, name: str) -> DictConfig:
    lm = cfg.lm
    values = {**common, "seed": seed, "run_name": name, "model": {"name": "compare", **lm.model},
              "data": {"batch_size": lm.batch_size}, "optim": {"lr": lr, "warmup_steps": lm.warmup_steps},
              "trainer": _trainer(lm.steps, lm.val_every, lm.val_batches)}
    return training_config(entry, [], values, OmegaConf.to_container(cfg.data, resolve=True))


def language_arms(cfg: DictConfig, entry: Entry, seeds: list[int], common: dict, runs: Path,
                  fingerprint: str) -> list[Arm]:
    arms = []
    for lr, seed in itertools.product(as_list("lm.lr", cfg.lm.lr), seeds):
        name = f"lm-{entry.name}-{lr_tag(lr)}-s{seed}"
        run_cfg = language_config(cfg, entry, lr, seed, common, name)
        check_run(name, run_cfg, recall=False)
        # The figures depend on the corpus's text too.
        arms.append(Arm(name, {**recorded_settings(run_cfg), "corpus_fingerprint": fingerprint},
                        lambda resume=False, c=run_cfg: unless_diverged(language_run, resumed(c, resume)),
                        labels={"task": "lm", "kind": entry.name, "lr": lr, "seed": seed},
                        log=runs / name / "train.log", checkpoint=runs / name / "last.ckpt"))
    return arms


def speed_arm(cfg: DictConfig, entry: Entry, common: dict) -> Arm:
    """Decoding and training figures of the language-modelling shape, freshly initialised: speed
    does not depend on the weights, and the trained model's context may be shorter than the
    contexts measured."""
    name = f"speed-{entry.name}"
    run_cfg = language_config(cfg, entry, as_list("lm.lr", cfg.lm.lr)[0], 0, common, name)
    check_run(name, run_cfg, recall=False)
    speed = speed_settings(cfg.speed)
    shape = OmegaConf.to_container(run_cfg, resolve=True)
    settings = {"model": shape["model"], "attn": shape["attn"], "vocab_size": run_cfg.data.vocab_size, "speed": speed}
    return Arm(name, settings, lambda resume=False, c=run_cfg: speed_figures(c, speed),
               labels={"task": "speed", "kind": entry.name})


def resumed(run_cfg: DictConfig, resume: bool) -> DictConfig:
    """The arm's run, continuing from its last.ckpt when the engine says it was interrupted."""
    return OmegaConf.merge(run_cfg, {"resume": True}) if resume else run_cfg


# Every arm trains in float32: `precision: auto` follows the machine (bf16-mixed on a GPU or on a CPU with
# bf16 instructions), and one study's numbers must not depend on which machine ran which arm.
ARM_PRECISION = "32-true"


def _trainer(steps: int, val_every: int, val_batches: int | None) -> dict:
    return {"max_steps": steps, "val_every_n_steps": val_every, "progress_bar": False, "precision": ARM_PRECISION,
            **({"limit_val_batches": val_batches} if val_batches else {})}


def check_run(name: str, run_cfg: DictConfig, recall: bool) -> None:
    """The errors training would meet, raised now, naming the arm."""
    try:
        run = TrainRun.from_config(run_cfg)
        model_config_from(run.model, run.attn, run.data.vocab_size)
        if recall:
            d = run.data
            if d.mix:
                mix_tasks(d, list(d.mix))
            else:
                RecallTask(vocab_size=d.vocab_size, seq_len=d.seq_len, pairs=d.pairs, examples=d.examples,
                           val_examples=d.val_examples, seed=d.seed, filler=d.filler, query_power=d.query_power)
    except ValueError as e:
        raise ConfigError(f"{name}: {e}") from None
