"""The attention comparison's settings, checked as typed before any arm is planned, and read per
kind (`per_kind`). Each setting's default, meaning and bound are declared once, in CompareSettings
(lm/config/compare.py); here is what no single setting's bound can say: the `data` group's, the
settings that bound each other, and the MQAR fillers lm.data.mqar writes."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from lm.config.compare import TASKS, CompareSettings
from lm.config.data import data_settings
from lm.data.recall_task import FILLERS
from lm.util.checks import as_list, require_choice
from lm.util.errors import ConfigError
from lm.util.settings import check_settings


def study_tasks(cfg: DictConfig) -> list[str]:
    """`tasks`, in the study's order: mqar (recall), lm (language modelling), speed (decoding)."""
    tasks = as_list("tasks", cfg.tasks)
    return [task for task in TASKS if task in tasks]


def study_seeds(cfg: DictConfig) -> list[int]:
    """seed, seed + 1, ...: `seeds` of them, so `seed=<n>` reruns every cell with other seeds."""
    return list(range(cfg.seed, cfg.seed + cfg.seeds))


def check_study_settings(cfg: DictConfig) -> None:
    """Every setting of the study, named as the user types it, before any arm is planned: an arm's
    own check would name its internal key (trainer.max_steps for lm.steps) after others trained."""
    if cfg.data.source == "mqar":
        raise ConfigError("data=mqar: the study's `data` is the language-modelling corpus (pystdlib, text or hf); "
                          "the recall runs are set under mqar.*")
    check_settings(cfg, CompareSettings)
    data_settings(cfg.data)
    require_choice("mqar.filler", cfg.mqar.filler, FILLERS)
    recall_lengths(cfg.mqar)
    speed = cfg.speed
    for context in as_list("speed.contexts", speed.contexts):
        if context <= speed.new_tokens:
            raise ConfigError(f"speed.contexts entry {context!r} must be an integer above "
                              f"speed.new_tokens={speed.new_tokens}")


PER_KIND_KEYS = ("mqar", "lm", "speed", "frontier", "seeds")


def for_kind(cfg: DictConfig, name: str) -> DictConfig:
    """The study's settings for one kind: `per_kind.<name>` on top of the rest. A kind too slow
    for the whole grid (additive's pairwise scores) runs fewer cells or shorter contexts, and the
    report names what it left out."""
    own = (cfg.per_kind or {}).get(name)
    if own is None:
        return cfg
    return OmegaConf.merge(cfg, own)


def check_per_kind(cfg: DictConfig, known: list[str]) -> None:
    """`per_kind` names only kinds the study could compare (`known`: attn configs, registered kinds
    and the `extra_kinds` names; a misspelt one would be ignored) and gives only the keys a kind may
    change, each checked as the study's own settings are."""
    per_kind = cfg.per_kind
    if per_kind is None:
        return
    if not isinstance(per_kind, DictConfig):
        raise ConfigError(f"per_kind={per_kind!r} must be a mapping: {{<kind>: {{mqar: {{widths: [64]}}}}}}")
    for name, own in per_kind.items():
        if name not in known:
            raise ConfigError(f"per_kind.{name} names no kind this study could compare; the kinds are "
                              f"{', '.join(sorted(known))}")
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
    if isinstance(m.seq_len, int):
        return dict.fromkeys(pairs, m.seq_len)
    lengths = as_list("mqar.seq_len", m.seq_len)
    if len(lengths) != len(pairs):
        raise ConfigError(f"mqar.seq_len={lengths} must be one length, or one per entry of mqar.pairs={pairs}")
    return dict(zip(pairs, lengths, strict=True))


def speed_settings(speed: DictConfig) -> dict:
    """`speed` as the speed arm records it, every list a list and every default filled in."""
    return {"contexts": as_list("speed.contexts", speed.contexts), "new_tokens": speed.new_tokens,
            "batches": as_list("speed.batches", speed.batches), "max_batch_tokens": speed.max_batch_tokens,
            "compile": bool(speed.compile), "train_contexts": as_list("speed.train_contexts", speed.train_contexts),
            "train_tokens": speed.train_tokens, "train_steps": speed.train_steps}
