"""Generation: prefill and the decoding loop (decode), sampling, int8 matmuls (quantize), and
the text command that scripts/generate.py runs (text)."""

from lm.generation.decode import generate, stream
from lm.util.errors import GenerationError

__all__ = ["GenerationError", "generate", "stream"]
