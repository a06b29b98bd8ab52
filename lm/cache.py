"""What each attention kind must keep to generate token by token.

A kind's `generation_state()` returns a CacheSpec; generation builds its caches from these,
and the benchmarks and README compute cache sizes from them.
"""

from __future__ import annotations

from dataclasses import dataclass


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
