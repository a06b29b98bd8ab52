"""Import a local Llama/Mistral folder as a native checkpoint: python scripts/import_hf.py src=DIR out=DIR"""

import sys

import hydra
from omegaconf import DictConfig

import lm.config  # noqa: F401  the settings' schemas, also where hydra.searchpath=... replaces conf's
from lm.config.attn import load_attention_kinds
from lm.config.import_hf import ImportHFSettings
from lm.config.settings import typed
from lm.util.cli import exit_on_user_error, run_script


@hydra.main(config_path="../conf", config_name="import_hf", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from lm.formats.checkpoint import save_checkpoint
    from lm.formats.hf import is_hf_folder, load_hf
    from lm.util.errors import CheckpointError
    from lm.util.paths import resolve_path

    with exit_on_user_error():
        cfg = typed(ImportHFSettings, cfg)  # the one place the composed config becomes typed settings
        src = resolve_path(cfg.src)
        if not is_hf_folder(src):
            raise CheckpointError(f"src={str(cfg.src)!r} is not a folder with a config.json")
        model, tokenizer = load_hf(src)
        out = resolve_path(cfg.out)
        path = save_checkpoint(out / "last.ckpt", model.state_dict(), model.config, tokenizer.to_str(),
                               provenance={"imported_from": str(src)})
        tokenizer.save(str(out / "tokenizer.json"))
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(run_script(main, start=load_attention_kinds))  # the kinds outside lm/ too
