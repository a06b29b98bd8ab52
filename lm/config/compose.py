"""conf/'s configs composed outside a Hydra app: the benchmarks and other argparse commands that read
a group's option (a data source, a model shape) as training would compose it, the schema's defaults
under what the option's YAML states."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def compose_train(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """conf/train.yaml with `overrides` (`["data=pystdlib_tests"]`), as `scripts/train.py` composes it."""
    from hydra import compose, initialize_config_dir

    import lm.config  # noqa: F401  the schemas conf/train.yaml composes

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=[*overrides, "logger=none"])


__all__ = ["CONF_DIR", "compose_train"]
