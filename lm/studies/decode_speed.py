"""The one decode-speed measurer of the studies: greedy decoding of a batch of one prompt."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lm.generation.decode import stream
from lm.model.transformer import Transformer

WARM_UP_PROMPT, WARM_UP_TOKENS = 64, 8


@dataclass
class DecodeSpeed:
    tokens_per_s: float  # new tokens of every row per second of the decoding steps, the prefill not counted
    prefill_s: float
    cache_bytes: int  # the cache once the prompt and the new tokens are in
    tokens: int  # prompt and new tokens


@torch.no_grad()
def decode_speed(model: Transformer, prompt: list[int], new_tokens: int, batch: int = 1) -> DecodeSpeed:
    """Greedy decoding of `new_tokens` after `prompt` in each of `batch` rows, timed after a short
    warm-up run, which takes the first call's one-off costs (allocations, lazy set-up) out of the
    figure; short, as a second prefill of a long context would cost as much as the measurement."""
    list(stream(model, [prompt[-WARM_UP_PROMPT:]] * batch, min(WARM_UP_TOKENS, new_tokens)))
    run = stream(model, [prompt] * batch, new_tokens)
    for _ in run:
        pass
    stats = run.stats
    return DecodeSpeed(tokens_per_s=stats["new_tokens"] / stats["decode_s"], prefill_s=stats["prefill_s"],
                       cache_bytes=stats["cache_bytes"], tokens=batch * len(prompt) + stats["new_tokens"])
