"""The `logger` group's settings (conf/logger/*.yaml): where a run's metrics go."""

from __future__ import annotations

from dataclasses import dataclass

from lm.util.settings import Checked, choice, setting

LOGGERS = ("wandb", "csv", "none")


@dataclass(kw_only=True)
class LoggerSettings(Checked):
    kind: str = setting("wandb", "wandb (offline unless WANDB_MODE or WANDB_API_KEY say otherwise) | csv | none",
                        choice(LOGGERS))
    project: str = setting("lm", "wandb's project")


__all__ = ["LOGGERS", "LoggerSettings"]
