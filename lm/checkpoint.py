"""Reading checkpoints safely: plain data and tensors only, never arbitrary pickled objects.

A training checkpoint is Lightning's file plus an "lm" entry holding the model config (a
dict), the tokenizer (its JSON text) and the resolved run config (a dict).

Format versions: 1 stored the attention as a kind's name plus options; 2 stores every option
of every layer. Both are read (lm.config.upgrade_from_format_1); a newer one is refused.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import zipfile
from pathlib import Path

import torch
from tokenizers import Tokenizer

from lm.config import ModelConfig
from lm.errors import CheckpointError
from lm.model import Transformer

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)


def write_atomically(path: str | Path, write) -> Path:
    """Call write(tmp) beside `path`, then rename tmp into place: a crash or a full disk during
    the write leaves the previous file whole. Write errors become one clear CheckpointError."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"could not write checkpoint {str(path)!r}: {e.strerror or e}; "
                              "the previous checkpoint is untouched") from None
    return path


def read_checkpoint(path: str | Path) -> dict:
    """The checkpoint's contents, loaded with `weights_only=True` so no code in it can run."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if not zipfile.is_zipfile(path):  # every torch.save since 1.6 writes a zip archive
        raise CheckpointError(f"checkpoint {str(path)!r} is not a readable torch file (not a torch zip archive)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))
        what = f" ({found.group(1)})" if found else ""
        raise CheckpointError(f"checkpoint {str(path)!r} was refused by the safe loader: it holds objects other "
                              f"than tensors and plain data{what}, which could run code") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {str(path)!r} is not a readable torch file ({first})") from None
    if not isinstance(ckpt, dict) or "lm" not in ckpt or "state_dict" not in ckpt:
        raise CheckpointError(f"checkpoint {str(path)!r} is not an lm training checkpoint (no 'lm' entry)")
    check_version(ckpt["lm"].get("format_version"), f"checkpoint {str(path)!r}")
    return ckpt


def check_version(version, what: str) -> None:
    if version not in READABLE_VERSIONS:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        readable = ", ".join(map(str, READABLE_VERSIONS))
        raise CheckpointError(f"{what} has format_version={version!r}; this lm reads versions {readable}"
                              + ("; a newer lm wrote it: upgrade lm to read it" if newer else ""))


def stored_model_config(entry: dict) -> ModelConfig:
    """The ModelConfig of a checkpoint's "lm" entry (or an export's config.json), any readable format."""
    return ModelConfig.from_dict(entry["model_config"], entry.get("format_version", entry.get("lm_format_version")))


def model_state_dict(ckpt: dict) -> dict[str, torch.Tensor]:
    """The Transformer's own parameters out of a LightningModule state dict."""
    prefix = "model."
    return {k[len(prefix):]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}


def load(path: str | Path, device: str | torch.device = "cpu") -> tuple[Transformer, Tokenizer]:
    """(model in eval mode, tokenizer) from a training checkpoint, an exported safetensors folder,
    or a local Hugging Face Llama / Mistral folder."""
    from lm.hf import is_hf_folder, load_hf

    if is_hf_folder(path):
        meta = json.loads((Path(path) / "config.json").read_text())
        if "lm_format_version" in meta:
            return load_safetensors_folder(Path(path), meta, device)
        return load_hf(path, device, meta)
    ckpt = read_checkpoint(path)
    config = stored_model_config(ckpt["lm"])
    model = Transformer(config)
    try:
        model.load_state_dict(model_state_dict(ckpt))
    except RuntimeError as e:
        detail = " ".join(str(e).split())[:300]
        raise CheckpointError(f"checkpoint {str(path)!r} does not match its model config: {detail}") from None
    if not ckpt["lm"].get("tokenizer"):
        raise CheckpointError(f"checkpoint {str(path)!r} holds no tokenizer")
    tokenizer = Tokenizer.from_str(ckpt["lm"]["tokenizer"])
    return model.to(device).eval(), tokenizer


def save_checkpoint(path: str | Path, state_dict: dict[str, torch.Tensor], config: ModelConfig,
                    tokenizer_json: str, run_config: dict | None = None, provenance: dict | None = None,
                    global_step: int = 0) -> Path:
    """Write a checkpoint `load` and `read_checkpoint` accept, without a Lightning trainer.

    Written to a temporary file and renamed into place, so a crash never leaves half a file."""
    ckpt = {
        "state_dict": {f"model.{k}": v for k, v in state_dict.items()},
        "global_step": global_step,
        "lm": {"format_version": FORMAT_VERSION, "model_config": config.to_dict(), "tokenizer": tokenizer_json,
               "run_config": run_config or {}, "provenance": provenance or {}},
    }
    return write_atomically(path, lambda tmp: torch.save(ckpt, tmp))


def export_safetensors(model: Transformer, tokenizer: Tokenizer, out: str | Path) -> Path:
    """A folder of plain data: model.safetensors, config.json and tokenizer.json; `load` reads it."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        del state["head.weight"]  # the same tensor as embed.weight; safetensors stores it once
    files = {
        "model.safetensors": lambda p: save_file(state, str(p), metadata={"format": "pt"}),
        "config.json": lambda p: p.write_text(json.dumps(
            {"lm_format_version": FORMAT_VERSION, "model_config": model.config.to_dict()}, indent=2)),
        "tokenizer.json": lambda p: tokenizer.save(str(p)),
    }
    for name, write in files.items():  # each file complete before it takes its name
        write_atomically(out / name, write)
    return out


def load_safetensors_folder(folder: Path, meta: dict,
                            device: str | torch.device = "cpu") -> tuple[Transformer, Tokenizer]:
    """A folder export_safetensors wrote; `meta` is its config.json."""
    from safetensors.torch import load_file

    check_version(meta.get("lm_format_version"), f"{str(folder)!r}")
    config = stored_model_config(meta)
    state = load_file(str(folder / "model.safetensors"))
    if config.tie_embeddings:
        state["head.weight"] = state["embed.weight"]
    model = Transformer(config)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        detail = " ".join(str(e).split())[:300]
        raise CheckpointError(f"{str(folder)!r} does not match its config.json: {detail}") from None
    return model.to(device).eval(), Tokenizer.from_file(str(folder / "tokenizer.json"))
