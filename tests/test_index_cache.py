"""runtime.layers.index_cache: a sparse-attention indexer's key cache and the per-request layout its scoring
runs in, over the block tables of a real KVCacheManager (prefill, then decode steps)."""

import pytest
import torch
from test_attention import BS, metadata

from runtime.errors import UserError
from runtime.kv_cache import KVCacheManager
from runtime.layers.attention import cache_info_of
from runtime.layers.index_cache import IndexKeyCache, by_request

DIM, LENS = 4, [3, 1, 5]


def test_by_request_puts_each_request_in_a_row_of_its_own():
    md = metadata(True, LENS, [0, 0, 0], [[1], [2], [3, 4]], BS, "full")
    x = torch.arange(9.0)[None, :, None].expand(1, 9, 2)
    cos, sin = by_request((x, -x), md)
    assert cos.shape == (3, 5, 2) and torch.equal(sin, -cos)
    assert cos[:, :, 0].tolist() == [[0, 1, 2, 0, 0], [3, 0, 0, 0, 0], [4, 5, 6, 7, 8]]


def test_keys_are_cached_and_each_query_sees_its_own_requests_up_to_itself():
    layer = IndexKeyCache(DIM)
    info = cache_info_of(layer, torch.float32)
    assert [(e.num_kv_heads, e.head_dim, e.v_head_dim) for e in info.entries] == [(1, DIM, 0)]
    kv = KVCacheManager(info, 32, BS)
    layer.k_cache, layer.v_cache = torch.zeros(32, BS, 1, DIM), torch.zeros(32, BS, 1, 0)
    gen, hist = torch.Generator().manual_seed(0), {}
    for new in (dict(enumerate(LENS)), *[dict.fromkeys(range(3), 1)] * 4):
        rids, lens = list(new), list(new.values())
        computed = [len(hist[r]) if r in hist else 0 for r in rids]
        for r, c, n in zip(rids, computed, lens):
            assert kv.allocate_slots(r, c, n)
        md = metadata(not hist, lens, computed, kv.block_tables(rids)["full"], BS, "full")
        fresh = torch.randn(1, sum(lens), DIM, generator=gen)
        keys, visible = layer(by_request(fresh, md), md)
        for b, (r, c, n, a) in enumerate(zip(rids, computed, lens, md.actual_seq_lengths_cu_q.tolist())):
            hist[r] = torch.cat([hist.get(r, fresh[0, :0]), fresh[0, a : a + n]])
            # prefill: the request's fresh tokens; decode: its context at the block table's slots
            assert torch.equal(keys[b, : c + n], hist[r])
            for j in range(n):
                assert visible[b, j].tolist() == [s <= c + j for s in range(keys.shape[1])]


def test_by_request_refuses_what_is_not_one_row_per_token():
    md = metadata(True, LENS, [0, 0, 0], [[1], [2], [3, 4]], BS, "full")
    assert by_request(None, md) is None
    with pytest.raises(UserError, match=r"HF's layout \[1, 9, \.\.\.\], not \[9, 2\]"):
        by_request(torch.zeros(9, 2), md)


def test_keys_of_one_head_written_heads_first_come_back_heads_first():
    """MiniMax-M3's indexer keeps its keys as [B, 1, Lq, dim]: cached alike, returned as [B, 1, S, dim]."""
    md = metadata(True, LENS, [0, 0, 0], [[1], [2], [3, 4]], BS, "full")
    flat, heads_first = IndexKeyCache(DIM), IndexKeyCache(DIM)
    for layer in (flat, heads_first):
        layer.k_cache, layer.v_cache = torch.zeros(8, BS, 1, DIM), torch.zeros(8, BS, 1, 0)
    k = by_request(torch.randn(1, sum(LENS), DIM, generator=torch.Generator().manual_seed(0)), md)
    keys, visible = flat(k, md)
    keys_4d, visible_4d = heads_first(k[:, None], md)
    assert torch.equal(keys_4d, keys[:, None]) and torch.equal(visible_4d, visible)
    assert torch.equal(heads_first.k_cache, flat.k_cache)
    with pytest.raises(UserError, match="one key per token, not 2 heads"):
        heads_first(k[:, None].expand(-1, 2, -1, -1), md)
