"""scripts/export.py's settings: each one's default, meaning and bound, declared once here.

conf/export.yaml composes them (`export_settings`), its --help lists them, and the script checks
them before the checkpoint is read. `gguf_type` is checked by the GGUF writer, which declares the
types it writes (lm.formats.gguf.TYPES).
"""

from __future__ import annotations

from dataclasses import dataclass

from lm.config.settings import store
from lm.util.settings import Checked, choice, setting

FORMATS = ("safetensors", "hf", "gguf")


@dataclass(kw_only=True)
class ExportSettings(Checked):
    ckpt: str = setting(help="a training checkpoint")
    format: str = setting("safetensors", "safetensors: model.safetensors + config.json + tokenizer.json, which "
                                         "lm.load reads; hf: a transformers folder (Llama for softmax, Qwen3 "
                                         "with qk_norm, Mistral for one undilated sliding window, Qwen3-Next for "
                                         "attn=qwen3_next, Kimi Linear for attn=kimi_linear); gguf: one .gguf "
                                         "file for llama.cpp, Ollama, LM Studio (softmax MHA/GQA/MQA models)",
                             choice(FORMATS))
    gguf_type: str = setting("f32", "with format=gguf: f32, f16 or q8_0 (1-D tensors stay f32)")
    out: str = setting(help="the folder to write (format=gguf: the .gguf file)")


store("export_settings", ExportSettings)

__all__ = ["FORMATS", "ExportSettings"]
