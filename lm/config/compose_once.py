"""A script start composes its config once, not twice.

Before a script runs, Hydra 1.3 asks `Hydra.get_mode` whether `hydra.mode` makes it a single run or a
sweep. That composes the whole config (as for a sweep: sweeps not checked, a group choice left as ???
skipped) only to read that one key and drop the rest; `Hydra.run` then composes the same config again
(hydra-ecosystem/hydra#3440, open). A composition of conf/train.yaml takes about 100 ms (Intel Xeon,
family 6 model 207): every script start paid it twice, and so did every row of the command-line fuzz
table that gets past composing.

The first composition is exactly the one `run` makes whenever two things hold: no override is a sweep
(a single run refuses those) and no group choice is left missing (a single run refuses it; a sweep's
composition skips it). Only those two steps read the mode. So while `get_mode` composes, the config
loader keeps its result if both hold, and the loader's next call, if it is `run`'s (same config name and
overrides, a single run), returns it instead of composing again. The config is handed out once: the next
call takes it or drops it. Everything else composes as Hydra does: a sweep (`-m`, or overrides that
sweep, which a single run then refuses as before), a missing choice, a failed composition, and every
composition outside a script start (hydra.compose, the sweep's own jobs, --cfg).
"""

from __future__ import annotations

from typing import Any

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.hydra import Hydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

READING_MODE = "_lm_reading_mode"  # set on the config loader while get_mode composes
KEPT = "_lm_kept_for_run"  # (config name, overrides, config) on the config loader, for run's call
MODE_OVERRIDE = "hydra.mode=RUN"


def compose_once_per_start() -> None:
    if getattr(Hydra.get_mode, "keeps_its_composition", False):
        return  # installed already
    hydras_get_mode = Hydra.get_mode
    hydras_load_configuration = ConfigLoaderImpl.load_configuration

    def get_mode(self: Hydra, config_name: str | None, overrides: list[str]) -> Any:
        setattr(self.config_loader, READING_MODE, True)
        try:
            return hydras_get_mode(self, config_name, overrides)
        finally:
            vars(self.config_loader).pop(READING_MODE, None)

    def load_configuration(self: ConfigLoaderImpl, config_name: str | None, overrides: list[str],
                           run_mode: RunMode, from_shell: bool = True,
                           validate_sweep_overrides: bool = True) -> DictConfig:
        kept = vars(self).pop(KEPT, None)
        if kept is not None and validate_sweep_overrides and run_mode == RunMode.RUN:
            cfg = taken_for_run(kept, config_name, overrides)
            if cfg is not None:
                return cfg
        cfg = hydras_load_configuration(self, config_name, overrides, run_mode, from_shell=from_shell,
                                        validate_sweep_overrides=validate_sweep_overrides)
        if vars(self).get(READING_MODE) and a_single_run_composes_the_same(cfg, overrides):
            setattr(self, KEPT, (config_name, list(overrides), cfg))
        return cfg

    get_mode.keeps_its_composition = True
    Hydra.get_mode = get_mode
    ConfigLoaderImpl.load_configuration = load_configuration


def taken_for_run(kept: tuple, config_name: str | None, overrides: list[str]) -> DictConfig | None:
    """The kept config, if it is the one `run` asks for. Where the configs leave `hydra.mode` unset,
    Hydra's `_run_app` adds the override hydra.mode=RUN to the list get_mode was given; applying it
    to the kept config sets that key and records the override, as composing with it does."""
    kept_name, kept_overrides, cfg = kept
    if kept_name != config_name:
        return None
    if overrides == kept_overrides:
        return cfg
    if overrides == [*kept_overrides, MODE_OVERRIDE] and cfg.hydra.mode is None:
        cfg.hydra.mode = RunMode.RUN
        cfg.hydra.overrides.hydra.append(MODE_OVERRIDE)
        return cfg
    return None


def a_single_run_composes_the_same(cfg: DictConfig, overrides: list[str]) -> bool:
    """True when composing for a single run would give `cfg`, composed as for a sweep: the two differ
    only in refusing sweeps among the overrides and refusing a group choice left missing."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides=overrides)
    except Exception:  # unreachable after a composition parsed them; composing again says what is wrong
        return False
    if any(override.is_sweep_override() for override in parsed):
        return False
    choices = cfg.hydra.runtime.choices
    return not any(OmegaConf.is_missing(choices, group) for group in choices)


__all__ = ["a_single_run_composes_the_same", "compose_once_per_start", "taken_for_run"]
