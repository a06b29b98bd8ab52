"""What the attention kinds' caches share: the batch they decode (CacheContext) and the contract
each layer's cache keeps.

Every kind declares its needs as a CacheSpec (`layer.generation_state()`) and builds its own
cache (`layer.build_cache(context, max_len)`): full K/V buffers for softmax, a ring buffer for
sliding windows, the recurrent state (S, z) for linear attention. A cache

- declares the tensors it holds, `tensors()`: a dict of name -> tensor, each with the batch row
  first, written in place and never replaced. Nothing else is written by a decoding step (a
  shared test holds it so), so byte counts, CUDA-graph marking and the row operations of
  lm.model.generation_cache.CacheContext (reset a row, prefill one row while the others keep
  decoding) work from this declaration alone;
- takes the inputs its kind computes per position: `attend(*inputs)` for the next T positions
  (prefill, chunk by chunk) and `decode(*inputs, pos)` for one position on fixed shapes (what a
  compiled step runs). q, k, v for the kinds built on GroupedQKV; MLA's (q, latent); gated delta's
  rows before its convolution with their write strengths and decays. Only its own layer calls them.

The CacheContext is the bookkeeping every layer's cache of one batch reads: how many slots each
row has consumed, and how many leading slots of each row are left padding (prompts of different
lengths are left-padded into one batch; padded slots are never attended and never enter a state).
Rows are "aligned" while they have consumed the same number of slots (after a batch prefill);
`attend` needs them aligned, `decode` takes a slot per row, so rows replaced one at a time
decode side by side at their own positions.

- `attend(...)`: the next T slots after `seen`, a Python int;
- `decode(..., pos)`: one new slot per row, `pos` a (B,) long tensor. Every shape is fixed by the
  batch and `max_len`, buffers are written in place and masks span the whole buffer, so the step
  never syncs with the host and one compiled graph serves every step (gpt-fast's static KV cache).
  The caller advances the context after the step, outside any compiled code.

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


class CacheContext:
    """The slot bookkeeping one batch's layer caches share.

    `pad` (B,) counts each row's leading padding slots, `lengths` (B,) the slots each row has
    consumed (the slot its next token takes), both on the device; `row_slots` and `row_pad` are
    the same numbers on the host, kept beside them so that no prefill has to read the device."""

    def __init__(self, pad: torch.Tensor, max_len: int, dtype: torch.dtype, slot_table: bool):
        self.pad = pad.clone()  # (B,) leading padding slots of each row
        self.batch_size = pad.shape[0]
        self.max_len = max_len  # slots each row can take in all
        self.device = pad.device
        self.dtype = dtype
        self.row_pad = [int(p) for p in pad.tolist()]  # read once per batch
        self.row_slots = [0] * self.batch_size
        self.lengths = torch.zeros(self.batch_size, dtype=torch.long, device=self.device)  # (B,)
        # Full K/V buffers mask with a slot table; rings and recurrent states never read one, so
        # max_len may then be any size (decoding 10**12 tokens).
        self.slots = torch.arange(max_len, device=self.device) if slot_table else None  # (L,)

    @property
    def aligned(self) -> bool:
        """Whether every row has consumed the same number of slots (a batch prefill needs it)."""
        return len(set(self.row_slots)) <= 1

    @property
    def seen(self) -> int:
        """Slots every row has consumed: the batch's next prefill starts there."""
        if not self.aligned:
            raise ValueError(f"the cache's rows are at different slots {self.row_slots}: a batch prefill needs "
                             "them aligned; prefill a row on its own (CacheContext.prefill_row)")
        return self.row_slots[0] if self.row_slots else 0

    @property
    def has_padding(self) -> bool:
        return any(p > 0 for p in self.row_pad)

    def positions(self, T: int) -> torch.Tensor:
        """(B, T) RoPE positions of the next T slots: each row counts from its first real token."""
        slots = torch.arange(self.seen, self.seen + T, device=self.device)
        return (slots[None, :] - self.pad[:, None]).clamp(min=0)

    def real(self, first_slot: int, T: int) -> torch.Tensor:
        """(B, T) bool: which of slots first_slot .. first_slot+T-1 hold real tokens, not padding."""
        slots = torch.arange(first_slot, first_slot + T, device=self.device)
        return slots[None, :] >= self.pad[:, None]

    def decode_positions(self, pos: torch.Tensor) -> torch.Tensor:
        """(B, 1) RoPE positions of each row's slot pos (B,), without leaving the device."""
        return (pos - self.pad)[:, None].clamp(min=0)

    def decode_mask(self, pos: torch.Tensor) -> torch.Tensor:
        """(B, 1, 1, L) bool: the slots a query at its row's slot pos (B,) sees in a full K/V buffer:
        every real slot of the row up to and including its own. Only for kinds with context_limited
        = True: the others' caches must not grow with max_len, so no slot table is built for them."""
        slots = self.slots[None, :]  # (1, L)
        return ((slots >= self.pad[:, None]) & (slots <= pos[:, None]))[:, None, None]

    def advance(self, T: int) -> None:
        """Every row has consumed T more slots."""
        self.row_slots = [s + T for s in self.row_slots]
        self.lengths += T

    def take_row(self, row: int, other: CacheContext) -> None:
        """Row `row` takes the bookkeeping of `other`'s only row."""
        self.pad[row], self.lengths[row] = other.pad[0], other.lengths[0]
        self.row_pad[row], self.row_slots[row] = other.row_pad[0], other.row_slots[0]


def keep_in_place(held: tuple[torch.Tensor, ...], new: tuple[torch.Tensor, ...]) -> None:
    """Copy a recurrent state into its fixed buffers, so a compiled step keeps reading the same tensors."""
    for buffer, value in zip(held, new, strict=True):
        buffer.copy_(value)


def tensor_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def held_bytes(cache) -> int:
    """Bytes of the tensors a layer's cache declares (`tensors()`)."""
    return tensor_bytes(*cache.tensors().values())


def scatter_at(buffer: torch.Tensor, pos: torch.Tensor, new: torch.Tensor, dim: int = 2) -> None:
    """Write new (B, ..., 1, ...) into each row's slot pos (B,) along `dim` of buffer, in place.

    An indexed assignment (index_put_), not scatter_: inductor writes an index_put_ on a graph input
    in place, while a scatter_ followed by a read of the buffer made a compiled step copy the whole
    buffer (5.6 ms a layer for a 32k latent cache on one CPU thread, against 0.1 ms)."""
    where: list = [slice(None)] * buffer.dim()
    where[0] = torch.arange(pos.shape[0], device=pos.device)  # (B,): each row ...
    where[dim] = pos  # ... at its own slot
    buffer[tuple(where)] = new.select(dim, 0)  # (B, ...) without the slot dimension


def visibility_mask(context: CacheContext, q_slots: torch.Tensor, k_slots: torch.Tensor,
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
