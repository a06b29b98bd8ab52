"""Which attention should I use? Train every kind on recall and language modelling and measure it:
python scripts/compare.py [preset=quick] [kinds=[mha,linear]] [data=text data.paths=[...]]"""

import sys

import hydra
from omegaconf import DictConfig

import lm.config  # noqa: F401  the attn group's schemas, also where hydra.searchpath=... replaces conf's
from lm.config.attn import load_attention_kinds
from lm.util.cli import exit_on_user_error, run_script


@hydra.main(config_path="../conf", config_name="compare", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with exit_on_user_error():
        from lm.config.compare import CompareRun
        from lm.studies.compare import run_study

        run_study(CompareRun.from_config(cfg))


if __name__ == "__main__":
    sys.exit(run_script(main, start=load_attention_kinds))  # the kinds outside lm/ too
