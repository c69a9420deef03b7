"""Paged KV cache bookkeeping: block pools, per-request block tables, sizing."""

from .block_pool import NULL_BLOCK, BlockPool, KVCacheExhausted
from .cache_info import CacheEntry, ModelCacheInfo
from .kv_cache_manager import KVCacheManager
from .managers import FullAttentionManager, SingleTypeKVCacheManager, SlidingWindowManager
from .sizing import blocks_for_batch, blocks_for_memory, cdiv

__all__ = [
    "NULL_BLOCK",
    "BlockPool",
    "CacheEntry",
    "FullAttentionManager",
    "KVCacheExhausted",
    "KVCacheManager",
    "ModelCacheInfo",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "blocks_for_batch",
    "blocks_for_memory",
    "cdiv",
]
