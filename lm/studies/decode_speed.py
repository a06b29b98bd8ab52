"""The one decode-speed measurer of the studies: greedy decoding of a batch of one prompt."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lm.generation.decode import stream
from lm.model.transformer import Transformer

WARM_UP_PROMPT, WARM_UP_TOKENS = 64, 8


@dataclass
class DecodeSpeed:
    tokens_per_s: float  # new tokens of every row per second of the decoding steps after the first: the
    # prefill and the first step (compilation, with compile=True; first-touch allocations) not counted
    prefill_s: float
    cache_bytes: int  # the cache once the prompt and the new tokens are in
    tokens: int  # prompt and new tokens


@torch.no_grad()
def decode_speed(model: Transformer, prompt: list[int], new_tokens: int, batch: int = 1,
                 compile: bool = False) -> DecodeSpeed:
    """Greedy decoding of `new_tokens` (at least 3) after `prompt` in each of `batch` rows, timed
    after a short warm-up run, which takes the first call's one-off costs (lazy set-up) out of the
    figure; short, as a second prefill of a long context would cost as much as the measurement.
    The first step of the timed run is left out too: its cache has a new shape, which a compiled
    step compiles for (`compile=True`: the step, and on the CPU the prefill, through torch.compile)."""
    if new_tokens < 3:
        raise ValueError(f"new_tokens={new_tokens}: timing the steps after the first needs at least 3")
    list(stream(model, [prompt[-WARM_UP_PROMPT:]] * batch, min(WARM_UP_TOKENS, new_tokens), compile=compile))
    run = stream(model, [prompt] * batch, new_tokens, compile=compile)
    for _ in run:
        pass
    stats = run.stats
    # new_tokens per row: the first from the prefill's logits, then new_tokens - 1 steps, the first untimed
    timed_tokens = batch * (new_tokens - 2)
    return DecodeSpeed(tokens_per_s=timed_tokens / (stats["decode_s"] - stats["first_step_s"]),
                       prefill_s=stats["prefill_s"], cache_bytes=stats["cache_bytes"],
                       tokens=batch * len(prompt) + stats["new_tokens"])
