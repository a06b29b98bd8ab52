"""Reading checkpoints safely: plain data and tensors only, never arbitrary pickled objects.

A training checkpoint is Lightning's file plus an "lm" entry holding the model config (a
dict), the tokenizer (its JSON text) and the resolved run config (a dict).

Format versions: 1 stored the attention as a kind's name plus options; 2 stores every option
of every layer. Both are read (lm.config.upgrade_from_format_1); a newer one is refused.
"""

from __future__ import annotations

import json
import pickle
import re
import zipfile
from pathlib import Path

import torch
from tokenizers import Tokenizer

from lm.checks import is_count
from lm.config import ModelConfig
from lm.errors import CheckpointError, one_line
from lm.files import make_folder, write_atomically
from lm.model import Transformer

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)


def read_checkpoint(path: str | Path) -> dict:
    """The checkpoint's contents, loaded with `weights_only=True` so no code in it can run."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
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


def check_size_against_weights(values: dict, weights: dict, what: str, layer_prefix: str, embedding: str,
                               names: tuple[str, str, str] = ("n_layer", "vocab_size", "d_model")) -> None:
    """Refuse a config whose layer count or embedding size differs from the weights', before
    anything is built from it. `names`: the config's keys for layers, vocabulary and width."""
    if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()):
        raise CheckpointError(f"{what} holds weights that are not a mapping of names to tensors")
    for name in names:
        if name not in values:
            raise CheckpointError(f"{what} has no {name} in its config")
        value = values[name]
        if not is_count(value):
            raise CheckpointError(f"{what} has {name}={value!r} in its config; it must be a positive integer")
    n_layer, vocab_size, d_model = (values[name] for name in names)
    pattern = re.compile(re.escape(layer_prefix) + r"(\d+)\.")
    layers = {int(m.group(1)) for k in weights if (m := pattern.match(k))}
    if len(layers) != n_layer or max(layers, default=-1) != n_layer - 1:  # never range(n_layer): it may be 10^9
        raise CheckpointError(f"{what} says {names[0]}={n_layer} but its weights hold {len(layers)} layers")
    table = weights.get(embedding)
    if table is None or tuple(table.shape) != (vocab_size, d_model):
        shape = "none" if table is None else tuple(table.shape)
        raise CheckpointError(f"{what} says {names[1]}={vocab_size}, {names[2]}={d_model} but its weight "
                              f"{embedding} has shape {shape}")


def build_checked(config: ModelConfig, state: dict[str, torch.Tensor], what: str) -> Transformer:
    """The model with `state` loaded, after comparing every name and shape with the config's
    (the model is laid out on the meta device first, which allocates nothing) and refusing
    weights that are not finite."""
    with torch.device("meta"):
        skeleton = Transformer(config)
    expected = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    problems = [f"missing {k}" for k in expected if k not in state]
    problems += [f"unexpected {k}" for k in state if k not in expected]
    problems += [f"{k} has shape {tuple(state[k].shape)}, the config needs {expected[k]}"
                 for k in expected if k in state and tuple(state[k].shape) != expected[k]]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(f"{what} does not match its model config: {'; '.join(problems[:3])}{more}")
    for name, tensor in state.items():
        if not tensor.is_floating_point():
            raise CheckpointError(f"{what} holds {name} as {tensor.dtype}, not floating point")
        if not torch.isfinite(tensor).all():
            raise CheckpointError(f"{what} holds NaN or infinite values in {name}")
    model = Transformer(config)
    model.load_state_dict(state)
    return model


def read_tokenizer(text, vocab_size: int, what: str) -> Tokenizer:
    """A tokenizer from its JSON text, refused when it is unreadable or has ids the model lacks."""
    if not isinstance(text, str) or not text:
        raise CheckpointError(f"{what} holds no tokenizer")
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as e:  # the tokenizers library raises plain Exception for any malformed JSON
        raise CheckpointError(f"{what} holds a tokenizer that cannot be read ({one_line(e)})") from None
    if tokenizer.get_vocab_size() > vocab_size:
        raise CheckpointError(f"{what} holds a tokenizer of {tokenizer.get_vocab_size()} tokens for a model "
                              f"of vocab_size={vocab_size}")
    return tokenizer


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
    from lm.hf import is_hf_folder, load_hf, read_json_object

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
    from lm.hf import read_safetensors

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
