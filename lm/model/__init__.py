"""The model core: ModelConfig (every architectural choice as plain data) and the Transformer built
from it (embedding, blocks of attention and MLP, head). Imports lm.attention and lm.util only."""

from lm.model.config import ModelConfig
from lm.model.transformer import Transformer

__all__ = ["ModelConfig", "Transformer"]
