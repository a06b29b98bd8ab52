"""Reading checkpoints safely: plain data and tensors only, never arbitrary pickled objects.

A training checkpoint is Lightning's file plus an "lm" entry holding the model config (a
dict), the tokenizer (its JSON text) and the resolved run config (a dict).

Format versions: 1 stored the attention as a kind's name plus options; 2 stores every option
of every layer. Both are read (lm.model.config.upgrade_from_format_1); a newer one is refused.
"""

from __future__ import annotations

import json
import pickle
import re
import zipfile
from pathlib import Path

import torch
from tokenizers import Tokenizer

from lm.formats.checked import (
    build_checked,
    check_size_against_weights,
    read_json_object,
    read_safetensors,
    read_tokenizer,
)
from lm.formats.hf import is_hf_folder, load_hf
from lm.model.config import ModelConfig
from lm.model.transformer import Transformer
from lm.util.errors import CheckpointError
from lm.util.files import make_folder, write_atomically

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)


def read_checkpoint(path: str | Path) -> dict:
    """The checkpoint's contents, loaded with `weights_only=True` so no code in it can run."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if not path.is_file():  # /dev/null, a pipe, a socket: nothing a checkpoint is stored in
        raise CheckpointError(f"checkpoint {str(path)!r} is not a regular file")
    if not zipfile.is_zipfile(path):  # every torch.save since 1.6 writes a zip archive
        raise CheckpointError(f"checkpoint {str(path)!r} is not a readable torch file (not a torch zip archive)")
    damaged = first_damaged_record(path)
    if damaged:
        raise CheckpointError(f"checkpoint {str(path)!r} is damaged: {damaged}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))
        what = f" ({found.group(1)})" if found else ""
        raise CheckpointError(f"checkpoint {str(path)!r} was refused by the safe loader: it holds objects other "
                              f"than tensors and plain data{what}, which could run code") from None
    except Exception as e:  # a damaged archive fails anywhere in unpickling: zip, utf-8, struct, eof
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {str(path)!r} is not a readable torch file ({first})") from None
    if not isinstance(ckpt, dict) or "lm" not in ckpt or "state_dict" not in ckpt:
        raise CheckpointError(f"checkpoint {str(path)!r} is not an lm training checkpoint (no 'lm' entry)")
    for key in ("lm", "state_dict"):
        if not isinstance(ckpt[key], dict):
            raise CheckpointError(f"checkpoint {str(path)!r} has a {key!r} entry that is a "
                                  f"{type(ckpt[key]).__name__}, not a mapping")
    check_version(ckpt["lm"].get("format_version"), f"checkpoint {str(path)!r}")
    return ckpt


def first_damaged_record(path: Path) -> str | None:
    """What is wrong with the archive, or None. torch.load does not compare the CRC-32 that
    torch.save stores for every record, so a changed byte inside a weight would load as a
    different, still finite, number; reading the records back through zipfile checks each one."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        return f"its zip archive cannot be read ({e})"
    return f"record {bad!r} fails its CRC-32 check" if bad is not None else None


def check_version(version, what: str) -> None:
    if version not in READABLE_VERSIONS:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        readable = ", ".join(map(str, READABLE_VERSIONS))
        raise CheckpointError(f"{what} has format_version={version!r}; this lm reads versions {readable}"
                              + ("; a newer lm wrote it: upgrade lm to read it" if newer else ""))


def stored_model_config(entry: dict, weights: dict, what: str) -> ModelConfig:
    """The ModelConfig of a checkpoint's "lm" entry (or an export's config.json), any readable
    format, after checking that the weights hold as many layers and as large an embedding as it
    claims: a config can then never ask for more memory than the file itself holds."""
    values = entry.get("model_config")
    if not isinstance(values, dict):
        raise CheckpointError(f"{what} has a model config that is a {type(values).__name__}, not a mapping")
    check_size_against_weights(values, weights, what, layer_prefix="blocks.", embedding="embed.weight")
    try:
        return ModelConfig.from_dict(values, entry.get("format_version", entry.get("lm_format_version")))
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{what} has an unusable model config: {e}") from None


def model_state_dict(ckpt: dict) -> dict[str, torch.Tensor]:
    """The Transformer's own parameters out of a LightningModule state dict."""
    prefix = "model."
    return {k[len(prefix):]: v for k, v in ckpt["state_dict"].items() if isinstance(k, str) and k.startswith(prefix)}


def checkpoint_file(path: str | Path) -> Path:
    """A run folder stands for its last.ckpt."""
    path = Path(path)
    if path.is_dir() and not (path / "config.json").is_file() and (path / "last.ckpt").is_file():
        return path / "last.ckpt"
    return path


def load(path: str | Path, device: str | torch.device = "cpu") -> tuple[Transformer, Tokenizer]:
    """(model in eval mode, tokenizer) from a training checkpoint (or the run folder holding its
    last.ckpt), an exported safetensors folder, or a local Hugging Face Llama / Mistral folder.

    Nothing is built before the stored config has been checked against the stored tensors."""

    path = checkpoint_file(path)
    if is_hf_folder(path):
        meta = read_json_object(Path(path) / "config.json")
        if "lm_format_version" in meta:
            return load_safetensors_folder(Path(path), meta, device)
        return load_hf(path, device, meta)
    if path.is_dir():
        raise CheckpointError(f"{str(path)!r} is a folder with neither last.ckpt nor config.json")
    ckpt = read_checkpoint(path)
    what = f"checkpoint {str(path)!r}"
    state = model_state_dict(ckpt)
    config = stored_model_config(ckpt["lm"], state, what)
    tokenizer = read_tokenizer(ckpt["lm"].get("tokenizer"), config.vocab_size, what)
    return build_checked(config, state, what).to(device).eval(), tokenizer


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
    make_folder(out)
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

    what = f"{str(folder)!r}"
    check_version(meta.get("lm_format_version"), what)
    state = read_safetensors(folder / "model.safetensors")
    values = meta.get("model_config")
    if isinstance(values, dict) and values.get("tie_embeddings") is True and "embed.weight" in state:
        state["head.weight"] = state["embed.weight"]
    config = stored_model_config(meta, state, what)
    tokenizer_path = folder / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise CheckpointError(f"{what} has no tokenizer.json")
    tokenizer = read_tokenizer(tokenizer_path.read_text(encoding="utf-8", errors="replace"), config.vocab_size, what)
    return build_checked(config, state, what).to(device).eval(), tokenizer
