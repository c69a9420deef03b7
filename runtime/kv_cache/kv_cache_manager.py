"""KV cache bookkeeping for a whole model: one block pool and block table per attention-type group."""

from collections.abc import Hashable, Sequence

from .block_pool import BlockPool
from .cache_info import CacheEntry, ModelCacheInfo
from .managers import FullAttentionManager, SingleTypeKVCacheManager, SlidingWindowManager


def _manager_for(entry: CacheEntry, num_blocks: int, block_size: int) -> SingleTypeKVCacheManager:
    pool = BlockPool(num_blocks)
    if entry.sliding_window is None:
        return FullAttentionManager(pool, block_size)
    return SlidingWindowManager(pool, block_size, entry.sliding_window)


class KVCacheManager:
    """Each group has its own pool of `num_blocks`; every entry of a group is a [num_blocks, block_size, ...]
    cache tensor indexed by that group's block table."""

    def __init__(self, cache_info: ModelCacheInfo, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.groups: dict[str, list[CacheEntry]] = cache_info.groups()
        self._managers = {
            key: _manager_for(entries[0], num_blocks, block_size) for key, entries in self.groups.items()
        }
        self._requests: set[Hashable] = set()

    @property
    def group_keys(self) -> list[str]:
        return list(self.groups)

    def has_request(self, request_id: Hashable) -> bool:
        return request_id in self._requests

    def allocate_slots(
        self, request_id: Hashable, computed_tokens: int, num_new_tokens: int, lookahead_tokens: int = 0
    ) -> bool:
        """Cover positions [0, computed + new + lookahead) in every group, or change nothing and return False."""
        args = (request_id, computed_tokens, num_new_tokens, lookahead_tokens)
        if any(m.blocks_needed(*args) > m.pool.num_free_blocks for m in self._managers.values()):
            return False
        for m in self._managers.values():
            m.allocate(*args)
        self._requests.add(request_id)
        return True

    def free(self, request_id: Hashable) -> None:
        if request_id not in self._requests:
            raise KeyError(f"request {request_id!r} has no KV cache allocation")
        for m in self._managers.values():
            m.free(request_id)
        self._requests.remove(request_id)

    def block_tables(self, request_ids: Sequence[Hashable]) -> dict[str, list[list[int]]]:
        return {key: [m.block_table(r) for r in request_ids] for key, m in self._managers.items()}

    def num_free_blocks(self) -> dict[str, int]:
        return {key: m.pool.num_free_blocks for key, m in self._managers.items()}

    def usage(self) -> dict[str, float]:
        return {key: m.pool.usage for key, m in self._managers.items()}

    def stats(self) -> dict:
        """Pool size, blocks in use now and the most any group had in use at once."""
        pools = [m.pool for m in self._managers.values()]
        return {
            "layout": "paged",
            "num_blocks": pools[0].num_blocks - 1,
            "block_size": self.block_size,
            "used_blocks": max(p.num_blocks - 1 - p.num_free_blocks for p in pools),
            "peak_used_blocks": max(p.peak_used_blocks for p in pools),
        }

    def usage_summary(self) -> str:
        parts = (
            f"{key} {m.pool.usage:.1%} ({m.pool.num_free_blocks}/{m.pool.num_blocks - 1} free, "
            f"peak {m.pool.peak_used_blocks} used)"
            for key, m in self._managers.items()
        )
        return f"kv cache: {len(self._requests)} requests, " + ", ".join(parts)
