"""Caches more than one kind decodes with: every position's K and V (softmax, additive), and a
state of fixed size carried from position to position (linear, efficient).

Shapes: B batch, T new positions, nh query heads, nkv K/V heads, hs head size, L max_len.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from lm.attention.cache import CacheContext, keep_in_place, scatter_at, visibility_mask
from lm.attention.scores import softmax_attention
from lm.attention.sinks import masked_attention

State = tuple[torch.Tensor, ...]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision inputs (bf16 sums over thousands of positions lose a recurrent
    state); float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def without_autocast(fn: Callable) -> Callable:
    """Runs a recurrent kernel with autocast off, so that what it casts to accumulation_dtype stays
    there: under `bf16-mixed` every matmul runs in bf16 whatever its inputs' dtype, and a state
    carried across chunks would be rounded to bf16 at each product. The inputs still arrive in
    bf16 from the projections: the kernel's own arithmetic is what this keeps in float32."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        device_type = next(a for a in args if isinstance(a, torch.Tensor)).device.type
        if not torch.is_autocast_enabled(device_type):  # the usual case: nothing to turn off
            return fn(*args, **kwargs)
        with torch.autocast(device_type, enabled=False):
            return fn(*args, **kwargs)

    return run


class KVCache:
    """Preallocated K and V of every position, n_kv_head heads only: (B, nkv, max_len, hs) each."""

    def __init__(self, context: CacheContext, n_kv_head: int, head_dim: int, max_len: int,
                 sink_logit: torch.Tensor | None = None, softcap: float | None = None):
        shape = (context.batch_size, n_kv_head, max_len, head_dim)
        self.context, self.sink_logit, self.softcap = context, sink_logit, softcap
        self.k = torch.zeros(shape, dtype=context.dtype, device=context.device)
        self.v = torch.zeros(shape, dtype=context.dtype, device=context.device)

    def store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, nkv, T, hs) of the next T slots; K and V of every slot so far, (B, nkv, end, hs)."""
        start, end = self.context.seen, self.context.seen + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"the K/V cache holds {self.k.shape[2]} positions; {end} were asked for")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def causal_mask(self, T: int) -> torch.Tensor:
        """Which slots the next T queries see: (T, end), or (B, 1, T, end) with padded rows."""
        start = self.context.seen
        q_slots = torch.arange(start, start + T, device=self.k.device)
        k_slots = torch.arange(start + T, device=self.k.device)
        return visibility_mask(self.context, q_slots, k_slots, k_slots[None, :] <= q_slots[:, None])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, nh, T, hs) of the next T slots over every slot so far; k, v (B, nkv, T, hs) are stored."""
        start, T = self.context.seen, q.shape[2]
        keys, values = self.store(k, v)  # (B, nkv, end, hs)
        if self.sink_logit is None and not self.context.has_padding and (T == 1 or start == 0):
            # One new token sees every cached one; a first chunk is plain causal attention.
            return softmax_attention(q, keys, values, causal=T > 1, softcap=self.softcap)
        return masked_attention(q, keys, values, self.causal_mask(T), self.sink_logit, self.softcap)

    def store_at(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Write k, v (B, nkv, 1, hs) into each row's slot pos (B,) in place."""
        scatter_at(self.k, pos, k)
        scatter_at(self.v, pos, v)

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One query (B, nh, 1, hs) per row at its slot pos (B,) over the whole buffer, later slots masked."""
        self.store_at(k, v, pos)
        mask = self.context.decode_mask(pos)  # (B, 1, 1, L)
        return masked_attention(q, self.k, self.v, mask, self.sink_logit, self.softcap)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"k": self.k, "v": self.v}


class RecurrentCache:
    """A state of fixed size per K/V head, whatever the length, for the kinds that carry one
    (linear attention's (S, z), efficient attention's (N, D, m), gated delta's S and convolution
    window). The kind names its state tensors and gives two functions of its own per-position
    inputs and the state tuple (in the order named), each returning (out, new state):

      chunk(*inputs, state, real): the next T positions; `real` (B, T) bool marks the positions
        that count (None: all), and the others (left padding) must add nothing to the state;
      step(*inputs, state): one position, on fixed shapes and without reading the host.

    The inputs are whatever the kind computes per position: q, k and v for most, gated delta's
    rows before its convolution with their write strengths and decays; `time_dim` is the dimension
    of the first input that counts positions. No position enters: a state does not know slots.

    The buffers are allocated once and written in place, so a compiled step reads the same tensors.
    """

    def __init__(self, context: CacheContext, state: dict[str, torch.Tensor], chunk: Callable, step: Callable,
                 time_dim: int = 2):
        self.context, self.named_state, self.chunk, self.step, self.time_dim = context, state, chunk, step, time_dim
        self.state = tuple(state.values())

    def attend(self, *inputs: torch.Tensor) -> torch.Tensor:
        context, T = self.context, inputs[0].shape[self.time_dim]
        real = context.real(context.seen, T) if context.has_padding else None  # (B, T)
        out, state = self.chunk(*inputs, self.state, real)
        keep_in_place(self.state, state)
        return out.to(inputs[0].dtype)

    def decode(self, *inputs_and_pos: torch.Tensor) -> torch.Tensor:
        # A decoded position is always a real token: padding only ever precedes the prompt.
        out, state = self.step(*inputs_and_pos[:-1], self.state)
        keep_in_place(self.state, state)
        return out.to(inputs_and_pos[0].dtype)

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.named_state
