"""Export a checkpoint: python scripts/export.py ckpt=... out=DIR|FILE.gguf [format=safetensors|hf|gguf]"""

import sys

import hydra
from omegaconf import DictConfig

import lm.config  # noqa: F401  the settings' schemas, also where hydra.searchpath=... replaces conf's
from lm.config.attn import load_attention_kinds
from lm.config.export import ExportSettings
from lm.config.settings import typed
from lm.util.cli import exit_on_user_error, run_script


@hydra.main(config_path="../conf", config_name="export", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from lm.formats.checkpoint import export_safetensors, load
    from lm.formats.gguf import export_gguf
    from lm.formats.hf import export_hf
    from lm.util.paths import resolve_path

    with exit_on_user_error():
        cfg = typed(ExportSettings, cfg)  # the one place the composed config becomes typed settings
        exporters = {"hf": export_hf, "safetensors": export_safetensors,
                     "gguf": lambda model, tokenizer, out: export_gguf(model, tokenizer, out, cfg.gguf_type)}
        model, tokenizer = load(resolve_path(cfg.ckpt))
        out = exporters[cfg.format](model, tokenizer, resolve_path(cfg.out))
        c = model.config
        print(f"wrote {out} ({c.describe_attention()}; {c.n_kv_head}/{c.n_head} K/V heads)")


if __name__ == "__main__":
    sys.exit(run_script(main, start=load_attention_kinds))  # the kinds outside lm/ too
