"""Train a model: python scripts/train.py [attn=gqa] [model=small] [trainer.max_steps=2000] ..."""

import sys

import hydra
from omegaconf import DictConfig

import lm.config  # noqa: F401  the attn group's schemas, also where hydra.searchpath=... replaces conf's
from lm.config.attn import load_attention_kinds
from lm.util.cli import exit_on_user_error, run_script


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from lm.config.train import TrainRun
    from lm.training.run import train

    with exit_on_user_error():
        train(TrainRun.from_config(cfg))  # the one place the composed config becomes typed settings


if __name__ == "__main__":
    sys.exit(run_script(main, start=load_attention_kinds))  # the kinds outside lm/ too
