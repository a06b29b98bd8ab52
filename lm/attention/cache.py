"""Generation caches: what each attention kind keeps between decoding steps.

Every kind declares its needs as a CacheSpec (`module.generation_state()`) and builds its own
cache object (`module.build_cache(context, max_len)`): full K/V buffers for softmax, a ring
buffer for sliding windows, the recurrent state (S, z) for linear attention. A GenerationCache
holds one per layer plus what they share: how many slots have been consumed, and how many
leading slots of each row are left padding (prompts of different lengths are left-padded into
one batch; padded slots are never attended and never enter a linear state).

Two ways in, both on the same fixed buffers:
- `attend(q, k, v)`: the next T slots after `seen`, a Python int (prefill, chunk by chunk);
- `decode(q, k, v, pos)`: one new slot whose index `pos` is a 0-dim long tensor. Every shape is
  fixed by the batch and `max_len`, buffers are written in place and masks span the whole buffer,
  so the step never syncs with the host and one compiled graph serves every step (gpt-fast's
  static KV cache). The caller advances `seen` after the step, outside any compiled code.

Shapes: B batch, T new tokens in this call, S slots consumed so far, L max_len.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheSpec:
    """One layer's generation state.

    kind "kv": K and V of every past position (n_kv_head heads), up to the context limit.
    kind "ring": K and V of the last `positions` positions only, in a ring buffer.
    kind "recurrent": a fixed-size state per K/V head, `state_numel` numbers, whatever the length.
    """

    kind: str
    n_kv_head: int
    head_dim: int
    positions: int | None = None  # ring: buffer length
    state_numel: int = 0  # recurrent: numbers per K/V head

    def numel(self, seq_len: int, batch: int = 1) -> int:
        """Numbers held after `seq_len` tokens."""
        if self.kind == "kv":
            return batch * 2 * self.n_kv_head * seq_len * self.head_dim
        if self.kind == "ring":
            return batch * 2 * self.n_kv_head * min(seq_len, self.positions) * self.head_dim
        if self.kind == "recurrent":
            return batch * self.n_kv_head * self.state_numel
        raise ValueError(f"unknown cache kind {self.kind!r}")


class GenerationCache:
    """The per-layer caches of one batch of sequences, and the slot bookkeeping they share."""

    def __init__(self, model, pad: torch.Tensor, max_len: int, dtype: torch.dtype | None = None):
        self.pad = pad  # (B,) leading padding slots of each row
        self.batch_size = pad.shape[0]
        self.max_len = max_len  # slots this cache can take in all
        self.seen = 0  # slots consumed so far
        self.device = pad.device
        self.dtype = dtype or next(model.parameters()).dtype
        # Read once per batch: a per-layer check at every step would sync with the device.
        self.has_padding = bool((pad > 0).any())
        if model.context_limited:  # full K/V buffers: their decode_mask spans every slot
            self.slots = torch.arange(max_len, device=self.device)  # (L,)
            self.real_slots = self.slots[None, :] >= pad[:, None]  # (B, L): False on each row's left padding
        else:  # rings and recurrent states never read these; max_len may be any size (decoding 10**12 tokens)
            self.slots = self.real_slots = None
        self.layers = [block.attn.build_cache(self, max_len) for block in model.blocks]
        # The model's short convolutions before attention (lm.model.short_conv), where it has them.
        self.short_convs = [block.short_conv.build_state(self) if block.short_conv is not None else None
                            for block in model.blocks]
        if self.device.type == "cuda":
            # compile=true captures the decoding step as a CUDA graph, which may write in place only to
            # inputs at a fixed address: unmarked, inductor skips the graph ("mutated inputs") and the
            # step runs uncaptured. A new cache's buffers have new addresses: the graph is re-recorded.
            for tensor in self.held_tensors():
                torch._dynamo.mark_static_address(tensor)

    def held_tensors(self) -> list[torch.Tensor]:
        """The buffers the layers' caches and convolution states hold (alone or in tuples and lists):
        every tensor the decoding step writes. Parameters (a learned sink's logit) are left out."""
        held = []
        for part in (*self.layers, *self.short_convs):
            for value in vars(part).values() if part is not None else ():
                for item in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(item, torch.Tensor) and not isinstance(item, torch.nn.Parameter):
                        held.append(item)
        return held

    def positions(self, T: int) -> torch.Tensor:
        """(B, T) RoPE positions of the next T slots: each row counts from its first real token."""
        slots = torch.arange(self.seen, self.seen + T, device=self.device)
        return (slots[None, :] - self.pad[:, None]).clamp(min=0)

    def real(self, first_slot: int, T: int) -> torch.Tensor:
        """(B, T) bool: which of slots first_slot .. first_slot+T-1 hold real tokens, not padding."""
        slots = torch.arange(first_slot, first_slot + T, device=self.device)
        return slots[None, :] >= self.pad[:, None]

    def decode_positions(self, pos: torch.Tensor) -> torch.Tensor:
        """(B, 1) RoPE positions of slot `pos` (0-dim tensor), without leaving the device."""
        return (pos - self.pad)[:, None].clamp(min=0)

    def decode_mask(self, pos: torch.Tensor) -> torch.Tensor:
        """(B, 1, 1, L) bool: the slots a query at slot `pos` sees in a full K/V buffer: every real
        slot up to and including its own. Only for kinds with context_limited = True: the others'
        caches must not grow with max_len, so no slot table is built for them."""
        return (self.real_slots & (self.slots <= pos))[:, None, None]

    def advance(self, T: int) -> None:
        self.seen += T

    def nbytes(self) -> int:
        return sum(part.nbytes() for part in (*self.layers, *self.short_convs) if part is not None)


def keep_in_place(held: tuple[torch.Tensor, ...], new: tuple[torch.Tensor, ...]) -> None:
    """Copy a recurrent state into its fixed buffers, so a compiled step keeps reading the same tensors."""
    for buffer, value in zip(held, new, strict=True):
        buffer.copy_(value)


def tensor_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def visibility_mask(context: GenerationCache, q_slots: torch.Tensor, k_slots: torch.Tensor,
                    visible: torch.Tensor) -> torch.Tensor:
    """The boolean SDPA mask for queries at q_slots (T,) over keys at k_slots (K,).

    `visible` (T, K) is the kind's own rule (causal, a window ...). With padded rows, padding
    keys are hidden too, giving (B, 1, T, K); a padding query still sees itself, so no row of
    the mask is empty (an all-masked softmax row is NaN, and 0 x NaN would leak into real rows).
    """
    if not context.has_padding:
        return visible
    real_keys = k_slots[None, None, :] >= context.pad[:, None, None]  # (B, 1, K)
    itself = k_slots[None, :] == q_slots[:, None]  # (T, K)
    return ((visible[None] & real_keys) | itself[None])[:, None]  # (B, 1, T, K)
