"""The tokenizer recipe: byte-level BPE with one special token between documents.

Kept apart from the data modules so that loading and generating never import Lightning.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lm.util.distributed import is_main_process
from lm.util.errors import DataError

EOT = "<|endoftext|>"


def train_tokenizer(texts: Iterator[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style): any byte sequence encodes, so no text is ever unknown."""
    if vocab_size < 257:
        raise DataError(f"data.vocab_size={vocab_size} is too small: byte-level BPE needs 256 bytes + {EOT}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        # Its bars draw on a terminal only; in a log file they leave blank lines behind.
        show_progress=sys.stderr.isatty() and is_main_process(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer
