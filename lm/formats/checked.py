"""Turning untrusted files into a checked model: sizes against the weights, a model built only
from weights that fit it, a tokenizer that fits the vocabulary, JSON objects and safetensors read
with one-line errors. Shared by the native checkpoint and the transformers reader."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from tokenizers import Tokenizer

from lm.attention.base import WeightDeclarations
from lm.model.config import ModelConfig
from lm.model.transformer import Transformer
from lm.util.checks import is_count
from lm.util.errors import CheckpointError, one_line


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


# Trained weights stay within a few hundred; a product of two layers' weights of 1e6 is already 1e12,
# and a few more overflow float32 (3.4e38), leaving a model whose every output is 0 or NaN.
MAX_WEIGHT = 1e6


def with_current_names(model: Transformer, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with weights a layer saved under a former name renamed to today's: each module that
    renamed a weight says so in its `former_names` ({old: new}, relative to the module; declared on
    lm.attention.base.WeightDeclarations)."""
    renamed = dict(state)
    for prefix, module in model.named_modules():
        if not isinstance(module, WeightDeclarations):
            continue
        for old, new in module.former_names.items():
            old_key, new_key = f"{prefix}.{old}", f"{prefix}.{new}"
            if old_key in renamed and new_key not in renamed:
                renamed[new_key] = renamed.pop(old_key)
    return renamed


def build_checked(config: ModelConfig, state: dict[str, torch.Tensor], what: str) -> Transformer:
    """The model with `state` loaded, after comparing every name and shape with the config's
    (the model is laid out on the meta device first, which allocates nothing) and refusing
    weights that are not finite or too large to compute with in float32."""
    with torch.device("meta"):
        skeleton = Transformer(config)
    state = with_current_names(skeleton, state)
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
        largest = tensor.abs().max().item() if tensor.numel() else 0.0  # NaN propagates through max
        if not math.isfinite(largest):
            raise CheckpointError(f"{what} holds NaN or infinite values in {name}")
        if largest > MAX_WEIGHT:
            raise CheckpointError(f"{what} holds {name} with a weight of magnitude {largest:.3g}, beyond "
                                  f"{MAX_WEIGHT:g}: its activations would overflow float32")
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


def read_json_object(path: Path) -> dict:
    """A JSON file that must hold one object (a config), as a dict; anything else is one line."""
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{str(path)!r} is not readable JSON ({one_line(e, 100)})") from None
    if not isinstance(values, dict):
        raise CheckpointError(f"{str(path)!r} holds a JSON {type(values).__name__}, not an object")
    return values


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise CheckpointError(f"{str(path)!r} does not exist")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own SafetensorError and others for damaged files
        raise CheckpointError(f"{str(path)!r} is not a readable safetensors file "
                              f"({one_line(e)})") from None
