"""Sampling from a model: temperature and top-k over a prefix recomputed every step.

Shapes: B batch, T sequence length, V vocab size.
"""

from __future__ import annotations

import torch

from lm.model import Transformer


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None,
                generator: torch.Generator | None) -> torch.Tensor:
    """Next token ids (B, 1) from last-position logits (B, V); temperature 0 is greedy."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)


@torch.no_grad()
def generate(model: Transformer, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, seed: int | None = None) -> torch.Tensor:
    """idx (B, T) followed by max_new_tokens sampled tokens, as (B, T + max_new_tokens).

    The window is the last max_seq_len tokens, recomputed each step.
    """
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    generator = torch.Generator(device=idx.device).manual_seed(seed) if seed is not None else None
    for _ in range(max_new_tokens):
        window = idx[:, -model.config.max_seq_len:]  # (B, <= max_seq_len)
        logits = model(window)[:, -1, :]  # (B, V)
        idx = torch.cat([idx, sample_next(logits.float(), temperature, top_k, generator)], dim=1)
    return idx
