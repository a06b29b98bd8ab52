"""The `model` group's settings: the shape a run builds, each setting's meaning declared here and its
default taken from ModelConfig (lm.model.config), which also owns the bounds: a model built in code
and one trained from the command line check the same way.

conf/model/*.yaml compose them (`- /model/settings@_here_: model`) and state only the shape they
name (layers, width, heads); training turns them into a ModelConfig with the `attn` group's layers
(lm.training.settings.model_config_from).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lm.config.settings import boolean, library_setting, setting, store
from lm.model.config import ModelConfig


def model_setting(name: str, help: str) -> Any:
    """A setting whose default is ModelConfig's own and whose bound ModelConfig checks."""
    return library_setting(ModelConfig, name, help)


@dataclass(kw_only=True)
class ModelSettings:
    name: str = setting("custom", "the shape's name, in the run's default name (run_name: <attn>-<model>)")
    n_layer: int = model_setting("n_layer", "transformer blocks")
    d_model: int = model_setting("d_model", "the residual stream's width")
    n_head: int = model_setting("n_head", "query heads (the attn group's n_kv_head sets the K/V heads)")
    d_ff: int = model_setting("d_ff", "the MLP's hidden width")
    max_seq_len: int = model_setting("max_seq_len", "the longest sequence: the training windows and the context")
    tie_embeddings: bool = model_setting("tie_embeddings", "the output head shares the token embedding's weights")
    short_conv: int = model_setting("short_conv", "taps of a causal convolution before each attention layer "
                                                  "(lm/model/short_conv.py); 0: none")
    mlp: str = model_setting("mlp", "swiglu, relu2 (down(relu(up x)^2), one matrix fewer: widen d_ff 3/2 for "
                                    "equal size), or none (blocks of their mixer alone, as Based's recall models)")
    zero_init_out: bool = model_setting("zero_init_out", "the blocks' output projections start at zero (each block "
                                                         "starts as the identity)")
    qk_norm: bool | None = setting(None, "QK-norm (RMS-normalised queries and keys) in every layer whose attention "
                                         "kind has it, unless attn.qk_norm says otherwise; null: each kind's own "
                                         "choice", boolean(nullable=True))
    norm_eps: float = model_setting("norm_eps", "the epsilon of every RMSNorm (the blocks', the final one, QK-norm); "
                                                "1e-6 makes attn=qwen3_next and attn=kimi_linear exportable to "
                                                "Qwen3-Next and Kimi Linear")


store("model", ModelSettings, group="model/settings")

__all__ = ["ModelSettings"]
