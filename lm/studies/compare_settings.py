"""The attention comparison's settings (conf/compare.yaml, conf/preset/*.yaml), checked as typed
before any arm is planned, and read per kind (`per_kind`). Every default is the YAML's, composed
by Hydra: the code reads the keys and restates none of them."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from lm.data.mqar import FILLERS
from lm.util.checks import (
    as_list,
    require_bool,
    require_choice,
    require_fraction,
    require_in_interval,
    require_int,
    require_positive,
)
from lm.util.errors import ConfigError

TASKS = ("mqar", "lm", "speed")


def study_tasks(cfg: DictConfig) -> list[str]:
    """`tasks`, in the study's order: mqar (recall), lm (language modelling), speed (decoding)."""
    tasks = as_list("tasks", cfg.tasks)
    if not tasks:
        raise ConfigError(f"tasks=[] is empty: give one or more of {', '.join(TASKS)}")
    for task in tasks:
        if task not in TASKS:
            raise ConfigError(f"tasks entry {task!r} is not one of {', '.join(TASKS)}")
    return [task for task in TASKS if task in tasks]


def learning_rates(name: str, value) -> list[float]:
    """The swept learning rates of `mqar.lr` or `lm.lr`: one value, or a list."""
    lrs = as_list(name, value)
    if not lrs:
        raise ConfigError(f"{name}=[] is empty: give at least one learning rate")
    for lr in lrs:
        require_positive(name if len(lrs) == 1 else f"{name} entry", lr)
    if len(set(lrs)) < len(lrs):
        raise ConfigError(f"{name}={lrs} names a learning rate more than once")
    return lrs


def study_seeds(cfg: DictConfig) -> list[int]:
    """seed, seed + 1, ...: `seeds` of them, so `seed=<n>` reruns every cell with other seeds."""
    count = cfg.seeds
    require_int("seed", cfg.seed, minimum=0)
    require_int("seeds", count)
    return list(range(cfg.seed, cfg.seed + count))


def check_study_settings(cfg: DictConfig) -> None:
    """Every number of the study, named as the user types it, before any arm is planned: an arm's
    own check would name its internal key (trainer.max_steps for lm.steps) after others trained."""
    if cfg.data.get("source") == "mqar":
        raise ConfigError("data=mqar: the study's `data` is the language-modelling corpus (pystdlib, text or hf); "
                          "the recall runs are set under mqar.*")
    study_tasks(cfg)
    study_seeds(cfg)
    require_bool("report_only", cfg.report_only)
    require_fraction("data.val_fraction", cfg.data.get("val_fraction"))
    m, lm, speed = cfg.mqar, cfg.lm, cfg.speed
    for key in ("widths", "pairs"):
        values = as_list(f"mqar.{key}", m[key])
        if not values:
            raise ConfigError(f"mqar.{key}=[] is empty: give at least one value, or tasks without mqar")
        for value in values:
            require_int(f"mqar.{key} entry", value)
    recall_lengths(m)
    for group, name, keys in (("mqar", m, ("vocab_size", "n_layer", "n_head", "ff_mult", "steps",
                                           "val_every", "batch_size", "val_examples")),
                              ("lm", lm, ("steps", "val_every", "batch_size"))):
        for key in keys:
            require_int(f"{group}.{key}", name[key])
    if m.examples is not None:
        require_int("mqar.examples", m.examples)
    require_int("mqar.short_conv", m.short_conv, minimum=0)
    require_choice("mqar.filler", m.filler, FILLERS)
    require_in_interval("mqar.query_power", m.query_power, 0, 1, open_low=True)
    if m.stop_at_accuracy is not None:
        require_fraction("mqar.stop_at_accuracy", m.stop_at_accuracy)
    if lm.val_batches is not None:
        require_int("lm.val_batches", lm.val_batches)
    for group, name in (("mqar", m), ("lm", lm)):
        learning_rates(f"{group}.lr", name.lr)
        require_int(f"{group}.warmup_steps", name.warmup_steps, minimum=0)
    require_int("speed.new_tokens", speed.new_tokens, minimum=3)  # the first step is not timed (decode_speed)
    batches = as_list("speed.batches", speed.batches)
    if not batches:
        raise ConfigError("speed.batches=[] is empty: give at least one batch size to decode at")
    for batch in batches:
        require_int("speed.batches entry", batch)
    contexts = as_list("speed.contexts", speed.contexts)
    if not contexts:
        raise ConfigError("speed.contexts=[] is empty: give at least one context length to decode at")
    for context in contexts:
        if not isinstance(context, int) or isinstance(context, bool) or context <= speed.new_tokens:
            raise ConfigError(f"speed.contexts entry {context!r} must be an integer above "
                              f"speed.new_tokens={speed.new_tokens}")
    if speed.max_batch_tokens is not None:
        require_int("speed.max_batch_tokens", speed.max_batch_tokens)
    require_bool("speed.compile", speed.compile)
    train_contexts = as_list("speed.train_contexts", speed.train_contexts)
    for context in train_contexts:
        require_int("speed.train_contexts entry", context)
    if train_contexts:
        require_int("speed.train_tokens", speed.train_tokens)
        require_int("speed.train_steps", speed.train_steps)


PER_KIND_KEYS = ("mqar", "lm", "speed", "seeds")


def for_kind(cfg: DictConfig, name: str) -> DictConfig:
    """The study's settings for one kind: `per_kind.<name>` on top of the rest. A kind too slow
    for the whole grid (additive's pairwise scores) runs fewer cells or shorter contexts, and the
    report names what it left out."""
    own = (cfg.per_kind or {}).get(name)
    if own is None:
        return cfg
    return OmegaConf.merge(cfg, own)


def check_per_kind(cfg: DictConfig) -> None:
    """`per_kind` gives only the keys a kind may change, each checked as the study's own settings are."""
    per_kind = cfg.per_kind
    if per_kind is None:
        return
    if not isinstance(per_kind, DictConfig):
        raise ConfigError(f"per_kind={per_kind!r} must be a mapping: {{<kind>: {{mqar: {{widths: [64]}}}}}}")
    for name, own in per_kind.items():
        if not isinstance(own, DictConfig):
            raise ConfigError(f"per_kind.{name}={own!r} must be a mapping of {', '.join(PER_KIND_KEYS)}")
        unknown = sorted(set(own) - set(PER_KIND_KEYS))
        if unknown:
            raise ConfigError(f"per_kind.{name}.{unknown[0]} is not a setting a kind may change: "
                              f"give {', '.join(PER_KIND_KEYS)}")
        try:  # also for a kind this study leaves out (kinds=[mha]): its entry stays for the full study
            check_study_settings(for_kind(cfg, name))
        except ConfigError as e:
            raise ConfigError(f"per_kind.{name}: {e}") from None


def recall_lengths(m: DictConfig) -> dict[int, int]:
    """pairs -> sequence length: `mqar.seq_len` is one length for every number of pairs, or a list
    with one per entry of `mqar.pairs` (Zoology's Figure 2 grows the sequence with the pairs)."""
    pairs = as_list("mqar.pairs", m.pairs)
    if isinstance(m.seq_len, int) and not isinstance(m.seq_len, bool):
        require_int("mqar.seq_len", m.seq_len)
        return dict.fromkeys(pairs, m.seq_len)
    lengths = as_list("mqar.seq_len", m.seq_len)
    if len(lengths) != len(pairs):
        raise ConfigError(f"mqar.seq_len={lengths} must be one length, or one per entry of mqar.pairs={pairs}")
    for length in lengths:
        require_int("mqar.seq_len entry", length)
    return dict(zip(pairs, lengths, strict=True))


def speed_settings(speed: DictConfig) -> dict:
    """`speed` as the speed arm records it, every list a list and every default filled in."""
    return {"contexts": as_list("speed.contexts", speed.contexts), "new_tokens": speed.new_tokens,
            "batches": as_list("speed.batches", speed.batches), "max_batch_tokens": speed.max_batch_tokens,
            "compile": bool(speed.compile), "train_contexts": as_list("speed.train_contexts", speed.train_contexts),
            "train_tokens": speed.train_tokens, "train_steps": speed.train_steps}
