"""Per-layer attention kinds: `pattern` names one registered kind per layer.

`attention=hybrid, attention_options={"pattern": ["linear", "linear", "linear", "softmax"]}`
mixes kinds in one model; the other options go to the kinds that take them.
"""

from __future__ import annotations

from torch import nn

from lm.attention import accepted_options, available_kinds, build_attention, get_kind, register
from lm.config import ConfigError, ModelConfig


@register("hybrid")
class HybridAttention:
    options = {"pattern": None}

    @classmethod
    def pattern(cls, config: ModelConfig) -> list[str]:
        return list(config.attention_options.get("pattern") or [])

    @classmethod
    def accepted_options(cls, config: ModelConfig) -> set[str]:
        """Any option of any single kind: the pattern may be changed without editing the rest."""
        names = {"pattern"}
        for kind in available_kinds():
            if kind != "hybrid":
                names |= accepted_options(kind, config)
        return names

    @classmethod
    def validate(cls, config: ModelConfig) -> None:
        pattern = cls.pattern(config)
        if len(pattern) != config.n_layer:
            raise ConfigError(f"pattern={pattern} has {len(pattern)} entries but n_layer={config.n_layer}")
        for i, kind in enumerate(pattern):
            if kind == "hybrid":
                raise ConfigError(f"pattern[{i}]='hybrid': a hybrid layer must name a single kind")
            get_kind(kind)
        for kind in set(pattern):
            if hasattr(get_kind(kind), "validate"):
                get_kind(kind).validate(config)

    @classmethod
    def build(cls, config: ModelConfig, layer_idx: int) -> nn.Module:
        layer_config = ModelConfig.from_dict({**config.to_dict(), "attention": cls.pattern(config)[layer_idx],
                                              "attention_options": cls.options_for(config, layer_idx)})
        return build_attention(layer_config, layer_idx)

    @classmethod
    def options_for(cls, config: ModelConfig, layer_idx: int) -> dict:
        kind = cls.pattern(config)[layer_idx]
        wanted = accepted_options(kind, config)
        return {k: v for k, v in config.attention_options.items() if k in wanted}
