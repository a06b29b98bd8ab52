"""lm: small decoder-only transformers with pluggable attention.

    from lm import ModelConfig, Transformer, load, generate, stream
"""

from lm.checkpoint import load
from lm.config import ConfigError, ModelConfig
from lm.generation import GenerationError, generate, stream
from lm.model import Transformer

__all__ = ["ConfigError", "GenerationError", "ModelConfig", "Transformer", "generate", "load", "stream"]
