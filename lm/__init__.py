"""lm: small decoder-only transformers with pluggable attention.

    from lm import ModelConfig, Transformer, load, generate, stream, quantize_int8

The package is layered; each folder imports only from the ones before it:
util -> attention -> model -> data -> formats -> generation -> config -> serving -> training -> studies.
"""

from lm.formats.checkpoint import load
from lm.generation.decode import generate, stream
from lm.generation.quantize import quantize_int8
from lm.model import ModelConfig, Transformer
from lm.util.errors import CheckpointError, ConfigError, GenerationError

__all__ = [
    "CheckpointError", "ConfigError", "GenerationError", "ModelConfig", "Transformer", "generate", "load",
    "quantize_int8", "stream",
]
