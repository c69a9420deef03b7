"""Per-request block tables for one attention type, all drawing from one BlockPool."""

from collections.abc import Hashable

from .block_pool import NULL_BLOCK, BlockPool, KVCacheExhausted
from .sizing import cdiv


class SingleTypeKVCacheManager:
    """Logical block i of a request holds positions [i * block_size, (i + 1) * block_size).

    Blocks no longer needed are only ever a prefix of the table; their slots hold NULL_BLOCK.
    """

    def __init__(self, pool: BlockPool, block_size: int):
        assert block_size > 0, block_size
        self.pool = pool
        self.block_size = block_size
        self._tables: dict[Hashable, list[int]] = {}
        self._num_dropped: dict[Hashable, int] = {}  # leading slots already returned to the pool

    @property
    def num_requests(self) -> int:
        return len(self._tables)

    def _num_stale_blocks(self, computed_tokens: int) -> int:
        """Leading logical blocks that tokens from `computed_tokens` on never read."""
        return 0

    def _plan(self, request_id: Hashable, computed_tokens: int, total_tokens: int) -> tuple[int, int, int]:
        """(stale blocks, blocks to return to the pool, blocks to take from it)."""
        assert 0 <= computed_tokens <= total_tokens, (computed_tokens, total_tokens)
        held = len(self._tables.get(request_id, ()))
        stale = self._num_stale_blocks(computed_tokens)
        to_free = max(0, min(stale, held) - self._num_dropped.get(request_id, 0))
        to_take = max(0, cdiv(total_tokens, self.block_size) - max(held, stale))
        return stale, to_free, to_take

    def blocks_needed(
        self, request_id: Hashable, computed_tokens: int, num_new_tokens: int, lookahead_tokens: int = 0
    ) -> int:
        """Net free blocks `allocate` would consume (blocks it returns first count against it)."""
        total = computed_tokens + num_new_tokens + lookahead_tokens
        _, to_free, to_take = self._plan(request_id, computed_tokens, total)
        return max(0, to_take - to_free)

    def allocate(
        self, request_id: Hashable, computed_tokens: int, num_new_tokens: int, lookahead_tokens: int = 0
    ) -> None:
        """Make the table cover positions [0, computed + new + lookahead); drop blocks no longer read."""
        total = computed_tokens + num_new_tokens + lookahead_tokens
        stale, to_free, to_take = self._plan(request_id, computed_tokens, total)
        if to_take - to_free > self.pool.num_free_blocks:
            raise KVCacheExhausted(
                f"request {request_id!r} needs {to_take - to_free} blocks, only {self.pool.num_free_blocks} free"
            )
        table = self._tables.setdefault(request_id, [])
        dropped = self._num_dropped.get(request_id, 0)
        if to_free:
            self.pool.free(table[dropped : dropped + to_free])
            table[dropped : dropped + to_free] = [NULL_BLOCK] * to_free
        table.extend([NULL_BLOCK] * max(0, stale - len(table)))
        table.extend(self.pool.allocate(to_take))
        self._num_dropped[request_id] = max(dropped, stale)

    def free(self, request_id: Hashable) -> None:
        if request_id not in self._tables:
            raise KeyError(f"request {request_id!r} holds no blocks")
        table = self._tables.pop(request_id)
        self.pool.free(table[self._num_dropped.pop(request_id) :])

    def block_table(self, request_id: Hashable) -> list[int]:
        return list(self._tables[request_id])


class FullAttentionManager(SingleTypeKVCacheManager):
    """Every token attends to all earlier ones: blocks live until the request is freed."""


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A token at position p attends to [p - window + 1, p]; blocks entirely before that are dropped."""

    def __init__(self, pool: BlockPool, block_size: int, window: int):
        super().__init__(pool, block_size)
        assert window > 0, window
        self.window = window

    def _num_stale_blocks(self, computed_tokens: int) -> int:
        return max(0, computed_tokens - self.window + 1) // self.block_size
