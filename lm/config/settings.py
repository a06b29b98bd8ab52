"""A script's settings (declared with lm.util.settings) as schemas Hydra composes: `store` puts a
settings dataclass's defaults in Hydra's ConfigStore, as plain data, so that a value is taken as typed
and its bound (not OmegaConf's type check) says what is wrong with it; a key the dataclass lacks is
refused by Hydra, in one line naming it (lm.util.cli). `${settings_help:<name>}` in a help template
is the options part of --help.
"""

from __future__ import annotations

from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf

from lm.util.settings import built, defaults, options_help

SCHEMAS: dict[str, type] = {}  # the name a primary config's defaults list uses -> its dataclass


def store(name: str, cls: type, group: str | None = None) -> None:
    """Register `cls`'s defaults as the config `name` (a primary config's first defaults entry), or
    as an option of `group` that a group's YAML composes (`- /optim/settings@_here_: adamw`)."""
    SCHEMAS[f"{group}/{name}" if group else name] = cls
    ConfigStore.instance().store(group=group, name=name, node=defaults(cls))


def settings_help(name: str, prefix: str = "") -> str:
    """options_help for a Hydra help template, whose `$` (string.Template's) the text escapes:
    `${settings_help:train_settings}`, or a group's with its prefix,
    `${settings_help:trainer/settings/trainer,trainer.}`."""
    return options_help(SCHEMAS[name], prefix).replace("$", "$$")


def plain(cfg) -> Any:
    """A composed config (or a section of one) as plain data, its interpolations resolved; plain data as it is."""
    if isinstance(cfg, (DictConfig, ListConfig)):  # a required setting left `???` is OmegaConf's one line, naming it
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    return cfg


def typed(cls: type, cfg) -> Any:
    """A script's composed config as its settings, built and checked: what the script's edge hands on."""
    return built(cls, plain(cfg))


# `${settings_help:generate_settings}` in a help template: the options part of --help, from the dataclass.
OmegaConf.register_new_resolver("settings_help", settings_help, replace=True)

__all__ = ["SCHEMAS", "plain", "settings_help", "store", "typed"]
