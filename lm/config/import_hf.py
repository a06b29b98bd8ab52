"""scripts/import_hf.py's settings, declared once here: conf/import_hf.yaml composes them
(`import_hf_settings`) and its --help lists them. Both are required; the script checks `src` is a
transformers folder before reading it."""

from __future__ import annotations

from dataclasses import dataclass

from lm.config.settings import store
from lm.util.settings import Checked, setting


@dataclass(kw_only=True)
class ImportHFSettings(Checked):
    src: str = setting(help="a local transformers Llama or Mistral folder: config.json, *.safetensors, "
                            "tokenizer.json")
    out: str = setting(help="the folder for last.ckpt + tokenizer.json")


store("import_hf_settings", ImportHFSettings)

__all__ = ["ImportHFSettings"]
