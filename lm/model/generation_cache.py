"""GenerationCache: one batch's decoding state for a whole model, layer by layer.

It builds each block's attention cache (`block.attn.build_cache`) and, where the model has them,
each short convolution's (`block.short_conv.build_cache`), on one CacheContext (lm.attention.cache)
that they all read for the slot bookkeeping. Every part declares its tensors (`tensors()`, batch
row first), so what the whole holds is known without looking inside any of them:

- `nbytes()` and `held_tensors()` (what a CUDA graph may write in place) are sums over the parts;
- rows are replaced one at a time: `reset_row(r)` empties row r, `prefill_row(r, ids)` runs a
  prompt through a fresh single-row cache and copies its tensors into row r, while the other rows
  keep their state (what a server admitting and freeing requests row by row needs). The row then
  decodes at its own slot: the decoding step takes one slot per row (`context.lengths`).

Shapes: B batch, T tokens, V vocab size.
"""

from __future__ import annotations

import torch

from lm.attention.cache import CacheContext, held_bytes


class GenerationCache(CacheContext):
    """The per-layer caches of one batch of sequences, and the slot bookkeeping they share."""

    def __init__(self, model, pad: torch.Tensor, max_len: int, dtype: torch.dtype | None = None):
        super().__init__(pad, max_len, dtype or next(model.parameters()).dtype, slot_table=model.context_limited)
        self.model = model
        self.layers = [block.attn.build_cache(self, max_len) for block in model.blocks]
        # The model's short convolutions before attention (lm.model.short_conv), where it has them.
        self.short_convs = [block.short_conv.build_cache(self) if block.short_conv is not None else None
                            for block in model.blocks]
        if self.device.type == "cuda":
            # compile=true captures the decoding step as a CUDA graph, which may write in place only to
            # inputs at a fixed address: unmarked, inductor skips the graph ("mutated inputs") and the
            # step runs uncaptured. A new cache's buffers have new addresses: the graph is re-recorded.
            for tensor in self.held_tensors():
                torch._dynamo.mark_static_address(tensor)

    def parts(self) -> list:
        """Every layer's attention cache and convolution cache (None where a block has none)."""
        return [*self.layers, *self.short_convs]

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor the parts declare: all that a decoding step writes."""
        return [t for part in self.parts() if part is not None for t in part.tensors().values()]

    def nbytes(self) -> int:
        return sum(held_bytes(part) for part in self.parts() if part is not None)

    # ------------------------------------------------------------------ rows one at a time

    def single_row(self) -> GenerationCache:
        """An empty cache for one row of this one's model, length and dtype."""
        pad = torch.zeros(1, dtype=torch.long, device=self.device)
        return GenerationCache(self.model, pad=pad, max_len=self.max_len, dtype=self.dtype)

    def replace_row(self, row: int, other: GenerationCache) -> None:
        """Row `row` takes the whole state of `other`, a single-row cache of the same model and length;
        the other rows keep theirs."""
        if not 0 <= row < self.batch_size:
            raise IndexError(f"row {row} is not one of the cache's {self.batch_size} rows")
        if other.batch_size != 1 or other.max_len != self.max_len or other.model is not self.model:
            raise ValueError("replace_row takes a single-row cache of the same model and max_len (single_row())")
        for mine, theirs in zip(self.parts(), other.parts(), strict=True):
            if mine is None:
                continue
            source = theirs.tensors()
            for name, tensor in mine.tensors().items():
                tensor[row].copy_(source[name][0])
        self.take_row(row, other)

    def reset_row(self, row: int) -> None:
        """Row `row` as a new cache's: nothing held, no slot consumed."""
        self.replace_row(row, self.single_row())

    def prefill_row(self, row: int, ids: torch.Tensor) -> torch.Tensor:
        """Run the prompt ids (T,) through a fresh single-row cache into row `row`, the other rows
        untouched; the logits (T, V) of its positions. The row then decodes at slot T."""
        single = self.single_row()
        logits = self.model(ids.view(1, -1).to(self.device), cache=single)[0]  # (T, V)
        self.replace_row(row, single)
        return logits
