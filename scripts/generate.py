"""Continue text with a trained model: python scripts/generate.py ckpt=... prompt="..." [max_new_tokens=200] ..."""

import sys

import hydra
from omegaconf import DictConfig

import lm.config  # noqa: F401  the settings' schemas, also where hydra.searchpath=... replaces conf's
from lm.config.attn import load_attention_kinds
from lm.util.cli import exit_on_user_error, quote_text_overrides, run_script


@hydra.main(config_path="../conf", config_name="generate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from lm.config.settings import typed
    from lm.generation.settings import GenerateSettings
    from lm.generation.text import generate_text

    with exit_on_user_error():
        generate_text(typed(GenerateSettings, cfg))  # the one place the composed config becomes typed settings


if __name__ == "__main__":
    from lm.generation.text import PROMPT_KEYS

    sys.argv = quote_text_overrides(sys.argv, keys=PROMPT_KEYS)
    sys.exit(run_script(main, start=load_attention_kinds))  # the kinds outside lm/ too
