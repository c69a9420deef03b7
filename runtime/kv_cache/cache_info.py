"""What the model caches: one entry per attention layer, grouped by attention type (one block table per group)."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheEntry:
    name: str
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sliding_window: int | None = None
    # values' head size where it differs from the keys' (MLA); 0: no values, the keys row is a latent they come from
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        if self.num_kv_heads <= 0 or self.head_dim <= 0 or self.value_dim < 0:
            raise ValueError(f"{self.name}: num_kv_heads and the key head size must be positive")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"{self.name}: sliding_window must be positive, got {self.sliding_window}")

    @property
    def attn_type(self) -> str:
        return "full" if self.sliding_window is None else f"sliding_window_{self.sliding_window}"

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def bytes_per_block(self, block_size: int) -> int:
        """K + V bytes one block of this layer takes."""
        return block_size * self.num_kv_heads * (self.head_dim + self.value_dim) * self.dtype.itemsize


@dataclass
class ModelCacheInfo:
    entries: list[CacheEntry]

    def __post_init__(self) -> None:
        if not self.entries:
            raise ValueError("ModelCacheInfo needs at least one cache entry")

    def groups(self) -> dict[str, list[CacheEntry]]:
        """Entries by attention type, in order of first appearance."""
        out: dict[str, list[CacheEntry]] = {}
        for e in self.entries:
            out.setdefault(e.attn_type, []).append(e)
        return out

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes one block id costs across the whole model (every entry, K and V)."""
        return sum(e.bytes_per_block(block_size) for e in self.entries)
