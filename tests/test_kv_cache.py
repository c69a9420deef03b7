import pytest
import torch

from runtime.errors import UserError
from runtime.kv_cache import (
    NULL_BLOCK,
    BlockPool,
    CacheEntry,
    FullAttentionManager,
    KVCacheExhausted,
    KVCacheManager,
    ModelCacheInfo,
    SlidingWindowManager,
    blocks_for_batch,
    blocks_for_memory,
)


def test_pool_allocate_free_and_usage():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    a = pool.allocate(3)
    assert a == [1, 2, 3] and NULL_BLOCK not in a
    assert pool.usage == 0.75
    pool.free([2])
    assert pool.num_free_blocks == 2
    assert pool.allocate(2) == [2, 4]  # lowest free ids first
    assert pool.usage == 1.0 and pool.peak_used_blocks == 4
    pool.free([1, 3])
    assert pool.peak_used_blocks == 4


def test_pool_exhaustion_is_all_or_nothing():
    pool = BlockPool(4)
    pool.allocate(2)
    with pytest.raises(KVCacheExhausted):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    assert isinstance(KVCacheExhausted(), RuntimeError)


def test_pool_rejects_bad_frees_without_changing_state():
    pool = BlockPool(8)
    a = pool.allocate(3)
    with pytest.raises(ValueError, match="null block"):
        pool.free([NULL_BLOCK])
    with pytest.raises(ValueError, match="unknown block 8"):
        pool.free([8])
    with pytest.raises(ValueError, match="double free of block 7"):
        pool.free([7])
    with pytest.raises(ValueError, match="double free of block 1"):
        pool.free([a[0], a[0]])
    assert pool.num_free_blocks == 4
    pool.free(a)
    with pytest.raises(ValueError, match="double free of block 2"):
        pool.free([2])
    with pytest.raises(ValueError):
        BlockPool(1)


def test_cache_info_groups_and_bytes():
    full = CacheEntry("l0", num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    swa = CacheEntry("l1", num_kv_heads=2, head_dim=8, dtype=torch.float32, sliding_window=64)
    info = ModelCacheInfo([swa, full, swa, full])
    assert full.attn_type == "full" and swa.attn_type == "sliding_window_64"
    assert list(info.groups()) == ["sliding_window_64", "full"]
    assert info.groups()["full"] == [full, full]
    # K+V * block_size * heads * head_dim * itemsize, summed over entries
    assert info.bytes_per_block(16) == 2 * (2 * 16 * 2 * 8 * 2) + 2 * (2 * 16 * 2 * 8 * 4)


def test_full_manager_tables_grow_and_free():
    pool = BlockPool(10)
    m = FullAttentionManager(pool, block_size=4)
    assert m.blocks_needed("a", 0, 5) == 2
    m.allocate("a", 0, 5)
    m.allocate("b", 0, 3, lookahead_tokens=2)
    assert m.block_table("a") == [1, 2] and m.block_table("b") == [3, 4]
    assert m.blocks_needed("a", 5, 3) == 0
    m.allocate("a", 5, 3)
    assert m.blocks_needed("a", 8, 1) == 1
    m.allocate("a", 8, 1)
    assert m.block_table("a") == [1, 2, 5] and m.num_requests == 2
    m.free("a")
    assert pool.num_free_blocks == 7 and m.num_requests == 1
    with pytest.raises(KeyError):
        m.free("a")
    with pytest.raises(KVCacheExhausted):
        m.allocate("c", 0, 4 * 8)
    assert pool.num_free_blocks == 7 and m.num_requests == 1


def test_sliding_window_evicts_and_stays_bounded():
    bs, window = 4, 6
    pool = BlockPool(64)
    m = SlidingWindowManager(pool, bs, window)
    m.allocate("r", 0, 8)  # prefill: all blocks, nothing stale yet
    assert m.block_table("r") == [1, 2]
    max_held = 0
    for pos in range(8, 21):  # decode one token at a time up to position 20
        need = m.blocks_needed("r", pos, 1)
        before = pool.num_free_blocks
        m.allocate("r", pos, 1)
        assert max(0, before - pool.num_free_blocks) == need <= 1
        max_held = max(max_held, 63 - pool.num_free_blocks)
    table = m.block_table("r")
    # position 20 reads [15, 20]: blocks 3..5; blocks 0..2 were returned and nulled
    assert len(table) == 6
    assert table[:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in table[3:]
    assert 63 - pool.num_free_blocks == 3
    assert max_held <= window // bs + 2
    m.free("r")
    assert pool.num_free_blocks == 63


def test_sliding_window_long_decode_fits_small_pool():
    bs, window = 4, 6
    pool = BlockPool(window // bs + 3)  # 4 allocatable blocks
    m = SlidingWindowManager(pool, bs, window)
    m.allocate("r", 0, 1)
    for pos in range(1, 500):
        assert m.blocks_needed("r", pos, 1) <= pool.num_free_blocks
        m.allocate("r", pos, 1)
    assert sum(b != NULL_BLOCK for b in m.block_table("r")) <= window // bs + 2


def test_sliding_window_blocks_needed_counts_frees():
    pool = BlockPool(4)  # 3 allocatable
    m = SlidingWindowManager(pool, block_size=4, window=4)
    m.allocate("r", 0, 12)
    assert pool.num_free_blocks == 0
    # new tokens from 12 read [9, ...]: logical blocks 0, 1 go back and 3, 4 take their ids
    assert m.blocks_needed("r", 12, 8) == 0
    m.allocate("r", 12, 8)
    assert m.block_table("r") == [NULL_BLOCK, NULL_BLOCK, 3, 1, 2]


def _mixed_info() -> ModelCacheInfo:
    return ModelCacheInfo(
        [
            CacheEntry("l0", 1, 4, torch.float16),
            CacheEntry("l1", 1, 4, torch.float16, sliding_window=4),
        ]
    )


def test_manager_all_or_nothing_across_groups():
    kv = KVCacheManager(_mixed_info(), num_blocks=5, block_size=4)
    assert kv.group_keys == ["full", "sliding_window_4"]
    assert [e.name for e in kv.groups["sliding_window_4"]] == ["l1"]
    assert kv.allocate_slots("a", 0, 12)
    assert kv.num_free_blocks() == {"full": 1, "sliding_window_4": 1}
    # sliding group could serve 8 more tokens (it drops stale blocks), the full group cannot
    before = kv.block_tables(["a"])
    assert not kv.allocate_slots("a", 12, 8)
    assert kv.block_tables(["a"]) == before
    assert kv.num_free_blocks() == {"full": 1, "sliding_window_4": 1}
    assert not kv.allocate_slots("b", 0, 8)
    assert not kv.has_request("b")
    assert kv.allocate_slots("a", 12, 4)
    assert kv.block_tables(["a"]) == {"full": [[1, 2, 3, 4]], "sliding_window_4": [[0, 0, 3, 1]]}  # 1 reused


def test_manager_free_usage_and_summary():
    kv = KVCacheManager(_mixed_info(), num_blocks=9, block_size=4)
    assert kv.allocate_slots("a", 0, 16)
    assert kv.allocate_slots(7, 0, 4)
    assert kv.has_request("a") and kv.has_request(7)
    assert kv.usage() == {"full": 5 / 8, "sliding_window_4": 5 / 8}
    assert "full 62.5% (3/8 free, peak 5 used)" in kv.usage_summary()
    kv.free("a")
    assert not kv.has_request("a")
    assert kv.stats() == {
        "layout": "paged",
        "num_blocks": 8,
        "block_size": 4,
        "used_blocks": 1,
        "peak_used_blocks": 5,
    }
    assert kv.usage() == {"full": 1 / 8, "sliding_window_4": 1 / 8}
    with pytest.raises(KeyError, match="'a'"):
        kv.free("a")
    with pytest.raises(KeyError):
        kv.free("never")


def test_sizing():
    assert blocks_for_batch(batch_size=3, max_seq_len=17, block_size=16) == 3 * 2 + 1
    assert blocks_for_memory(free_bytes=1000, fraction=0.5, bytes_per_block=100) == 5
    with pytest.raises(UserError, match="at least 2"):
        blocks_for_memory(free_bytes=1000, fraction=0.1, bytes_per_block=100)
    with pytest.raises(ValueError):
        blocks_for_memory(free_bytes=1000, fraction=0.0, bytes_per_block=100)


def test_the_pool_leaves_room_for_the_per_request_states(monkeypatch):
    from types import SimpleNamespace

    from runtime.engine import model_worker
    from runtime.engine.model_worker import ModelWorker

    monkeypatch.setattr(model_worker, "free_memory_bytes", lambda device: 10_000)
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(mem_fraction_static=0.5, block_size=16),
        batch_size_per_dp_rank=64,
        max_seq_len=1024,
    )
    worker = ModelWorker.__new__(ModelWorker)
    worker.config, worker.dist, worker.state_bytes = config, SimpleNamespace(device="cpu"), 0
    assert worker._blocks_from_memory(bytes_per_block=100) == 50
    worker.state_bytes = 4_000  # what the engine set aside after its start-up probe
    assert worker._blocks_from_memory(bytes_per_block=100) == 30
