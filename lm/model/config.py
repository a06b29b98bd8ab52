"""ModelConfig: every architectural choice of a model, as values that serialise to plain data.

`attention` is one typed spec per layer (lm.attention); `to_dict` writes every option of every
layer explicitly, so a checkpoint keeps its meaning even if a default in the code changes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lm.attention import AttentionSpec, LayerShape, as_layer_specs, layer_specs
from lm.model.layers import MLPS, NO_MLP
from lm.util.checks import require_bool, require_float32, require_int, require_positive
from lm.util.errors import ConfigError


def about(default: Any, help: str) -> Any:
    """A field of ModelConfig: its default and what it means (the `model` group's --help reads it)."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass
class ModelConfig:
    """Shape of a Llama-style decoder-only transformer.

    `n_kv_head` sets the K/V heads of every layer: equal to `n_head` is multi-head (MHA), 1 is
    multi-query (MQA), anything in between grouped-query (GQA); `None` means `n_head`.
    `attention` is a kind's name, one spec for every layer, or one spec (or name) per layer;
    it is stored as n_layer specs.
    """

    vocab_size: int = about(8192, "tokens the embedding and the head know (a run takes its tokenizer's)")
    n_layer: int = about(6, "transformer blocks")
    d_model: int = about(384, "the residual stream's width")
    n_head: int = about(6, "query heads (n_kv_head sets the K/V heads)")
    n_kv_head: int | None = about(None, "K/V heads of every layer; None: n_head")
    d_ff: int = about(1024, "the MLP's hidden width")
    max_seq_len: int = about(256, "the longest sequence: the training windows and the context")
    attention: Any = about("softmax", "a kind's name, one spec for every layer, or one spec (or name) per layer")
    rope_theta: float = about(10000.0, "RoPE's base: the longest wavelength of the rotary positions")
    norm_eps: float = about(1e-5, "the epsilon of every RMSNorm (the blocks', the final one, QK-norm); 1e-6 makes "
                                  "attn=qwen3_next and attn=kimi_linear exportable to Qwen3-Next and Kimi Linear")
    tie_embeddings: bool = about(True, "the output head shares the token embedding's weights")
    init_std: float = about(0.02, "the standard deviation of the weights' normal initialisation")
    short_conv: int = about(0, "taps of a causal convolution before each attention layer (lm/model/short_conv.py); "
                               "0: none")
    mlp: str = about("swiglu", "swiglu, relu2 (down(relu(up x)^2), one matrix fewer: widen d_ff 3/2 for equal "
                               "size), or none (blocks of their mixer alone, as Based's recall models)")
    zero_init_out: bool = about(False, "the blocks' output projections start at zero (each block starts as the "
                                       "identity)")
    attention_options: dataclasses.InitVar[dict | None] = None  # format 1 only: refused with the new spelling

    def __post_init__(self, attention_options: dict | None) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        for name in ("vocab_size", "n_layer", "d_model", "n_head", "n_kv_head", "d_ff", "max_seq_len"):
            require_int(name, getattr(self, name))
        for name in ("rope_theta", "norm_eps", "init_std"):
            require_positive(name, getattr(self, name))
            require_float32(name, getattr(self, name))
        require_bool("tie_embeddings", self.tie_embeddings)
        require_bool("zero_init_out", self.zero_init_out)
        if self.mlp not in (*MLPS, NO_MLP):
            raise ConfigError(f"mlp={self.mlp!r} is not one of {', '.join((*MLPS, NO_MLP))}")
        require_int("short_conv", self.short_conv, minimum=0)
        if self.d_model % self.n_head:
            raise ConfigError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} (d_model/n_head) must be even for RoPE")
        if self.n_kv_head > self.n_head:
            raise ConfigError(f"n_kv_head={self.n_kv_head} must not exceed n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ConfigError(f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}")
        if attention_options is not None:
            raise ConfigError("attention_options is gone: give the specs, e.g. attention=SlidingSpec(window=64), "
                              "or lm.attention.layer_specs(kind, n_layer, options)")
        self.attention = [spec.at(self.head_dim) for spec in as_layer_specs(self.attention, self.n_layer)]

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_groups(self) -> int:
        """Query heads that share one K/V head."""
        return self.n_head // self.n_kv_head

    def layer_shape(self, layer_idx: int) -> LayerShape:
        return LayerShape(self.d_model, self.n_head, self.n_kv_head, self.head_dim, layer_idx, self.norm_eps)

    def kinds(self) -> list[str]:
        return [spec.kind for spec in self.attention]

    def describe_attention(self) -> str:
        """'4 x linear(feature_map=elu, chunk_size=64, eps=1e-06)': each run of equal layers, in order."""
        runs: list[list] = []
        for spec in self.attention:
            if runs and runs[-1][1] == spec:
                runs[-1][0] += 1
            else:
                runs.append([1, spec])
        return ", ".join(f"{n} x {spec.describe()}" for n, spec in runs)

    def to_dict(self) -> dict:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["attention"] = [spec.to_dict() for spec in self.attention]
        return values

    @classmethod
    def from_dict(cls, values: dict, format_version: int | None = None) -> ModelConfig:
        """A config from `to_dict`'s plain data; `format_version` 1 reads what checkpoints of that
        format stored (a kind's name + `attention_options`), None or 2 today's per-layer list."""
        if not isinstance(values, dict):
            raise ConfigError(f"model config {values!r} must be a mapping")
        if format_version == 1:
            values = upgrade_from_format_1(values)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown model config field(s): {', '.join(unknown)}")
        return cls(**values)


def check_layers_build(config: ModelConfig) -> None:
    """One ConfigError line, before any data or training, unless every layer builds at the model's
    shape: what a kind checks against the head size or width (MLA's kv_rank and rope_dim) is checked
    by building each distinct layer on the meta device (no memory, no values)."""
    import torch  # here, not at the top: the config stays importable without building anything

    built = []  # compared by equality: a spec may hold a list, which hashes not
    for i, spec in enumerate(config.attention):
        if spec in built:
            continue
        try:
            with torch.device("meta"):
                spec.build(config.layer_shape(i))
        except (NotImplementedError, RuntimeError):  # an op the meta device lacks: the real build meets it
            pass
        built.append(spec)


def upgrade_from_format_1(values: dict) -> dict:
    """Format 1 named one kind plus its options; a hybrid named kinds in `pattern`, and sliding's
    `global_every` turned layers into softmax. Options no layer took were ignored then, so they
    are dropped here rather than refused."""
    values = dict(values)
    kind = values.pop("attention", "softmax")
    options = dict(values.pop("attention_options", None) or {})
    if kind == "hybrid":
        kind = options.pop("pattern")
    every = options.pop("global_every", None)
    n_layer = values.get("n_layer", ModelConfig.n_layer)
    values["attention"] = [s.to_dict() for s in layer_specs(kind, n_layer, options, every, strict=False)]
    return values


__all__ = ["AttentionSpec", "ConfigError", "ModelConfig", "check_layers_build"]
