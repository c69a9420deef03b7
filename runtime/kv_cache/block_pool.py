"""Free list of fixed-size KV cache blocks. Block 0 is the null block: padding in block tables, never handed out.

The lowest free ids go out first, so a pool sized from memory touches (and, on the host, makes resident) only
as many blocks as were ever in use at once.
"""

import heapq
from collections.abc import Iterable

NULL_BLOCK = 0


class KVCacheExhausted(RuntimeError):
    """Not enough free blocks for an allocation; the pool was left unchanged."""


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (null block + 1), got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(1, num_blocks))  # a heap
        self._is_free = [False] + [True] * (num_blocks - 1)
        self.peak_used_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        allocatable = self.num_blocks - 1
        return (allocatable - len(self._free)) / allocatable

    def allocate(self, n: int) -> list[int]:
        assert n >= 0, n
        if n > len(self._free):
            raise KVCacheExhausted(f"need {n} KV cache blocks, only {len(self._free)} free")
        ids = [heapq.heappop(self._free) for _ in range(n)]
        for b in ids:
            self._is_free[b] = False
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_blocks - 1 - len(self._free))
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Return blocks to the pool. Validates every id before changing anything."""
        ids = list(block_ids)
        seen: set[int] = set()
        for b in ids:
            if b == NULL_BLOCK:
                raise ValueError("cannot free the null block 0")
            if not 0 < b < self.num_blocks:
                raise ValueError(f"unknown block {b} (pool holds blocks 1..{self.num_blocks - 1})")
            if self._is_free[b] or b in seen:
                raise ValueError(f"double free of block {b}")
            seen.add(b)
        for b in ids:
            self._is_free[b] = True
            heapq.heappush(self._free, b)
