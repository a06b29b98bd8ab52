"""ModelConfig: every architectural choice of a model as plain values.

Plain strings, ints and floats only, so a config serialises to JSON, travels inside a
checkpoint and loads back with `torch.load(weights_only=True)` without unpickling classes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lm.errors import ConfigError  # noqa: F401  (re-exported: lm.config.ConfigError)


def _require_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}={value!r} must be an integer")
    if value < minimum:
        raise ConfigError(f"{name}={value!r} must be >= {minimum}")


def _require_positive_float(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name}={value!r} must be a positive number")


@dataclass
class ModelConfig:
    """Shape of a Llama-style decoder-only transformer.

    `n_kv_head` selects the attention variant of the softmax kind: equal to `n_head` is
    multi-head (MHA), 1 is multi-query (MQA), anything in between is grouped-query (GQA).
    `None` means `n_head` (MHA).
    """

    vocab_size: int = 8192
    n_layer: int = 6
    d_model: int = 384
    n_head: int = 6
    n_kv_head: int | None = None
    d_ff: int = 1024
    max_seq_len: int = 256
    attention: str = "softmax"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    # Options of the attention kind (e.g. a window size); kept as a plain dict so that a
    # new kind adds options without touching this class.
    attention_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        for name in ("vocab_size", "n_layer", "d_model", "n_head", "n_kv_head", "d_ff", "max_seq_len"):
            _require_int(name, getattr(self, name))
        for name in ("rope_theta", "norm_eps", "init_std"):
            _require_positive_float(name, getattr(self, name))
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError(f"tie_embeddings={self.tie_embeddings!r} must be true or false")
        if self.d_model % self.n_head:
            raise ConfigError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} (d_model/n_head) must be even for RoPE")
        if self.n_kv_head > self.n_head:
            raise ConfigError(f"n_kv_head={self.n_kv_head} must not exceed n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ConfigError(f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}")
        if not isinstance(self.attention_options, dict):
            raise ConfigError(f"attention_options={self.attention_options!r} must be a mapping")
        # Imported here because the registry imports this module.
        from lm.attention import check_kind

        check_kind(self.attention, self)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_groups(self) -> int:
        """Query heads that share one K/V head."""
        return self.n_head // self.n_kv_head

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown model config field(s): {', '.join(unknown)}")
        return cls(**values)
