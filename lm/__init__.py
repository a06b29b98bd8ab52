"""lm: small decoder-only transformers with pluggable attention.

    from lm import ModelConfig, Transformer, load, generate, stream, quantize_int8
"""

from lm.checkpoint import load
from lm.config import ConfigError, ModelConfig
from lm.generation import GenerationError, generate, stream
from lm.model import Transformer
from lm.quantize import quantize_int8

__all__ = [
    "ConfigError", "GenerationError", "ModelConfig", "Transformer", "generate", "load", "quantize_int8", "stream",
]
