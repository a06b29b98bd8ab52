"""lm: small decoder-only transformers with pluggable attention.

    from lm import ModelConfig, Transformer, load, generate
"""

from lm.checkpoint import load
from lm.config import ConfigError, ModelConfig
from lm.generation import generate
from lm.model import Transformer

__all__ = ["ConfigError", "ModelConfig", "Transformer", "generate", "load"]
