"""Serve a model over OpenAI's API: python scripts/serve.py ckpt=checkpoints/<run>/last.ckpt [port=8000] ..."""

import sys

import hydra
from omegaconf import DictConfig

import lm.config  # noqa: F401  the settings' schemas, also where hydra.searchpath=... replaces conf's
from lm.config.attn import load_attention_kinds
from lm.util.cli import exit_on_user_error, run_script


@hydra.main(config_path="../conf", config_name="serve", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from lm.config.serve import ServeSettings
    from lm.config.settings import typed
    from lm.serving.run import serve

    with exit_on_user_error():
        serve(typed(ServeSettings, cfg))  # the one place the composed config becomes typed settings


if __name__ == "__main__":
    sys.exit(run_script(main, start=load_attention_kinds))  # the kinds outside lm/ too
