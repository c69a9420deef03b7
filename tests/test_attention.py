"""Numerics of runtime.layers.attention against a naive per-request reference (float64, explicit loops).

Metadata is built like ExecutionEngine._build_model_inputs from the block tables of a real KVCacheManager
(or LegacyCacheRows), so prefill, decode, sliding-window eviction and the legacy layout run as in the engine.
"""

import os
import shutil
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runtime.engine.forward_metadata import ForwardMetaData
from runtime.engine.legacy_cache import LegacyCacheRows
from runtime.errors import UserError
from runtime.kernels import STALE_LOCK_S, _drop_stale_lock, host_decode_attention
from runtime.kv_cache import NULL_BLOCK, CacheEntry, KVCacheManager, ModelCacheInfo, cdiv
from runtime.layers.attention import (
    Attention,
    alibi_slopes,
    cache_info_of,
    distance_columns,
    distance_positions,
    probed_cache_keys,
    stack_attention,
)

H, KV, D, BS, SCALE, MAX_LEN = 8, 2, 16, 4, 0.3, 32
LENS = [1, 5, 11]
RUNS = [5, 5, 5, 2, 7, 7]  # prefill batches consecutive requests of one length


SINKS = torch.linspace(-1.0, 2.0, H)  # per query head; the upper ones outweigh most scores


def naive(
    q,
    k,
    v,
    rows,
    window=None,
    cap=None,
    sinks=None,
    tiled=False,
    alibi=None,
    chosen=None,
    bias=None,
    keep=None,
    by_distance=None,
):
    """One request: q [L, H, D], k/v [L, KV, D]; the outputs [len(rows), H, D] of query positions `rows`.
    A sink is one more logit in the softmax, with no value row. `tiled`: query head h reads kv head h % KV.
    `alibi` [H]: slope * (key position - query position) joins the scaled scores. `chosen`: the positions each
    row may read besides (an indexer's picks), for every head or a set per head. `bias` [L, KV]: joins the scores of its key; `keep`: a row reads
    only that many keys, those of the largest bias. `by_distance` [len(rows), H, E]: column d joins the score of
    the key d positions back, for d < E."""
    spread = (
        (lambda x: x.double().repeat(1, H // KV, 1))
        if tiled
        else (lambda x: x.double().repeat_interleave(H // KV, 1))
    )
    q, k, v = q.double(), spread(k), spread(v)
    bias = None if bias is None else spread(bias[..., None])[..., 0]
    out = torch.empty(len(rows), H, v.shape[-1], dtype=torch.float64)
    for n, i in enumerate(rows):
        visible = [j for j in range(i + 1) if window is None or j > i - window]
        for h in range(H):
            picked = chosen and (chosen[n] if isinstance(chosen[n], set) else chosen[n][h])
            js = visible if chosen is None else [j for j in visible if j in picked]
            if keep is not None and len(js) > keep:
                js = sorted(sorted(js, key=lambda j: -bias[j, h])[:keep])
            s = k[js, h] @ q[i, h] * SCALE
            if cap:
                s = torch.tanh(s / cap) * cap
            if alibi is not None:
                s = s + alibi[h].double() * (torch.tensor(js, dtype=torch.float64) - i)
            if bias is not None:
                s = s + bias[js, h]
            if by_distance is not None:
                back = [i - j for j in js]
                s = (
                    s
                    + torch.tensor(
                        [by_distance[n, h, d] if d < by_distance.shape[-1] else 0.0 for d in back]
                    ).double()
                )
            sink = None if sinks is None else sinks[h : h + 1] if sinks.dim() == 1 else sinks[n, h : h + 1]
            p = torch.softmax(s if sink is None else torch.cat([s, sink.double()]), 0)
            out[n, h] = p[: len(js)] @ v[js, h]
    return out


def metadata(is_prefill, lens_q, kv_len, tables, block_size, group) -> ForwardMetaData:
    """Mirror of ExecutionEngine._build_model_inputs for one cache group."""
    q, kv = torch.tensor(lens_q), torch.tensor(kv_len)
    cu = F.pad(q.cumsum(0), (1, 0))
    req = torch.repeat_interleave(torch.arange(len(lens_q)), q)
    positions = torch.arange(int(q.sum())) - cu[:-1][req] + kv[req]
    total = kv + q
    md = ForwardMetaData(
        is_prefill, kv, q, total, cu, positions, int(q.max()), int(total.max()), list(lens_q)
    )
    width = cdiv(md.max_seq_len_kv, block_size)
    table = torch.tensor([t[:width] + [0] * (width - len(t[:width])) for t in tables])
    md.block_table[group] = table
    md.slot_mapping[group] = table[req, positions // block_size] * block_size + positions % block_size
    return md


class Run:
    """One attention layer with its cache bookkeeping, fed random q/k/v; every step is checked against
    `naive` over the request's whole history, and the cache against the history at the mapped slots."""

    def __init__(
        self,
        window=None,
        cap=None,
        legacy=False,
        num_blocks=64,
        seed=0,
        sinks=None,
        dv=D,
        tiled=False,
        alibi=None,
        picks=None,
        keep=None,
        key_bias=False,
        tied=False,
        pick_block=1,
        pick_groups=0,
        distance=None,
        query_sinks=False,
    ):
        self.picks = picks  # positions an indexer picks for each query (selected=), one of them its own
        # or blocks of pick_block positions, per group of H / pick_groups heads when pick_groups (MiniMax-M3)
        self.pick_block, self.pick_groups = pick_block, pick_groups
        self.key_bias, self.keep = key_bias or keep is not None, keep  # a bias per key (key_bias=)
        self.tied = tied  # biases drawn from three values: equal ones everywhere
        self.distance = distance  # width of a bias table by backward distance per query (distance_bias=)
        self.query_sinks = query_sinks  # a sink per query token and head, drawn each step (Inkling2's)
        self.layer = Attention(
            H,
            D,
            SCALE,
            KV,
            sliding_window=window,
            soft_cap=cap,
            legacy=legacy,
            v_head_dim=dv,
            kv_heads_tiled=tiled,
            alibi_slopes=alibi,
            key_bias=self.key_bias,
            keep_keys=keep,
            select_block=pick_block,
        )
        self.alibi = None if alibi is None else torch.tensor(alibi)
        self.window, self.cap, self.legacy, self.sinks, self.dv = window, cap, legacy, sinks, dv
        self.tiled = tiled
        self.gen = torch.Generator().manual_seed(seed)
        dk = self.layer.key_width
        if legacy:
            self.kv, shape, v_shape = (
                LegacyCacheRows(4, MAX_LEN),
                (4, MAX_LEN, KV * dk),
                (4, MAX_LEN, KV * dv),
            )
        else:
            info = ModelCacheInfo([CacheEntry("attn", KV, dk, torch.float32, window, dv)])
            self.kv, shape = KVCacheManager(info, num_blocks, BS), (num_blocks, BS, KV, dk)
            v_shape = (*shape[:-1], dv)
        self.layer.k_cache, self.layer.v_cache = torch.zeros(shape), torch.zeros(v_shape)
        if not legacy:  # the null block is only ever read under the mask: make any leak show
            for c in (self.layer.k_cache, self.layer.v_cache):
                c[NULL_BLOCK] = 100 * torch.randn(
                    c[NULL_BLOCK].shape, generator=torch.Generator().manual_seed(7)
                )
        self.hist: dict = {}  # request id -> [q [L, H, D], k [L, KV, D], v [L, KV, D], bias [L, KV]]

    @property
    def group(self):
        return self.layer.cache_group

    def tables(self, rids):
        return self.kv.block_tables(list(rids))[self.group]

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen)

    def step(self, new: dict) -> torch.Tensor:
        """{request id: new tokens}; all new requests (prefill) or one token each for running ones (decode)."""
        rids, lens = list(new), list(new.values())
        prefill = not any(r in self.hist for r in rids)
        computed = [len(self.hist[r][1]) if r in self.hist else 0 for r in rids]
        for r, c, n in zip(rids, computed, lens):
            assert self.kv.allocate_slots(r, c, n)
        tables = self.tables(rids)
        md = metadata(prefill, lens, computed, tables, self.kv.block_size, self.group)
        T = sum(lens)
        q, k, v = self.randn(T, H, D), self.randn(T, KV, D), self.randn(T, KV, self.dv)
        bias = 3 * self.randn(T, KV) if self.key_bias else torch.zeros(T, KV)
        if self.tied:
            bias = bias.sign()
        selected = self.pick(md, computed) if self.picks else None
        table = 2 * self.randn(T, H, self.distance) if self.distance else None
        sinks = 2 * self.randn(T, H) if self.query_sinks else self.sinks
        out = self.layer(
            q.flatten(1),
            k.flatten(1),
            v.flatten(1),
            md,
            sinks,
            selected=selected,
            key_bias=bias if self.key_bias else None,
            distance_bias=table,
        )
        out = out.view(T, H, self.dv)
        for b, (r, c, n, a) in enumerate(zip(rids, computed, lens, md.actual_seq_lengths_cu_q.tolist())):
            h = self.hist.setdefault(r, [q[:0], k[:0], v[:0], bias[:0]])
            h[:] = [torch.cat([x, y[a : a + n]]) for x, y in zip(h, (q, k, v, bias))]
            chosen = None if selected is None else [self.chosen(selected[b], j) for j in range(n)]
            ref = naive(
                *h[:3],
                range(c, c + n),
                self.window,
                self.cap,
                sinks[a : a + n] if self.query_sinks else sinks,
                self.tiled,
                self.alibi,
                chosen,
                h[3] if self.key_bias else None,
                self.keep,
                None if table is None else table[a : a + n],
            )
            torch.testing.assert_close(out[a : a + n].double(), ref, atol=1e-5, rtol=0)
        self.check_cache(rids, tables)
        return out

    def pick(self, md, computed) -> torch.Tensor:
        """[B, Lq, picks] positions in each request's context row (prefill: its fresh tokens; decode: its block
        table's slots), random but for each query's own position; padded queries' picks are never read. With
        pick_groups, [B, groups, Lq, picks] of blocks, -1 (none) among them."""
        slots = (
            md.max_seq_len_q if md.is_prefill else md.block_table[self.group].shape[1] * self.kv.block_size
        )
        blocks, groups = -(-slots // self.pick_block), (self.pick_groups,) if self.pick_groups else ()
        shape = (md.batch_size, *groups, md.max_seq_len_q, self.picks)
        out = torch.randint(-1 if groups else 0, blocks, shape, generator=self.gen)
        own = torch.arange(md.max_seq_len_q)[None, :] + (
            0 if md.is_prefill else torch.tensor(computed)[:, None]
        )
        own = own.clamp(max=slots - 1) // self.pick_block
        out[..., 0] = own[:, None] if groups else own
        return out

    def chosen(self, picks, j) -> set | list[set]:
        """The positions query j of a request may read (its picks [Lq, k] or [groups, Lq, k]), per head if
        grouped."""
        positions = lambda blocks: {
            b * self.pick_block + i for b in blocks.tolist() if b >= 0 for i in range(self.pick_block)
        }
        if not self.pick_groups:
            return positions(picks[j])
        return [positions(picks[h // (H // self.pick_groups), j]) for h in range(H)]

    def check_cache(self, rids, tables):
        """K/V of every position still held sits at slot table[p // bs] * bs + p % bs; the window is held."""
        bs = self.kv.block_size
        owner = self.layer.cache_owner
        kc, vc = owner.k_cache.view(-1, KV, owner.key_width), owner.v_cache.view(-1, KV, self.dv)
        for r, table in zip(rids, tables):
            _, k, v, bias = self.hist[r]
            if self.key_bias:  # cached as one more key channel, which a query channel of 1 / scale reads
                k = torch.cat([k, bias[..., None]], -1)
            for p in range(len(k)):
                block = table[p // bs]
                if block == NULL_BLOCK and not self.legacy:
                    assert self.window and p <= len(k) - 1 - self.window, (r, p, table)
                    continue
                assert torch.equal(kc[block * bs + p % bs], k[p]) and torch.equal(
                    vc[block * bs + p % bs], v[p]
                )


def prefill_then_decode(run, lens, steps, order=None):
    """Prefill requests 0..n-1 (packed in `order`), then `steps` decode steps, alternating the batch order."""
    order = order or range(len(lens))
    outs = [run.step({i: lens[i] for i in order})]
    rids = list(range(len(lens)))
    return outs + [run.step({i: 1 for i in (rids if s % 2 else rids[::-1])}) for s in range(steps)]


@pytest.mark.parametrize(
    "lens, window, cap, sinks",
    [
        (LENS, None, None, None),
        ([7], None, None, None),
        (LENS, 3, None, None),
        (LENS, 6, None, None),
        ([9], 3, None, None),
        (RUNS, None, None, None),
        (RUNS, 3, 1.5, SINKS),
        (LENS, None, 1.5, None),
        (LENS, 3, 1.5, None),
        (LENS, None, None, SINKS),
        (LENS, 3, None, SINKS),
    ],
    ids=[
        "full",
        "full-single",
        "window3",
        "window6",
        "window3-single",
        "same-length-runs",
        "same-length-runs-window3-softcap-sinks",
        "softcap",
        "softcap-window3",
        "sinks",
        "sinks-window3",
    ],
)
def test_prefill_then_decode_matches_naive(lens, window, cap, sinks):
    run = Run(window, cap, sinks=sinks)
    prefill_then_decode(run, lens, steps=6)
    if window:  # blocks wholly before the window were handed back and read as the null block
        assert any(NULL_BLOCK in t for t in run.tables(range(len(lens))))


@pytest.mark.parametrize("window", [3, 6])
def test_sliding_window_with_evicted_and_reused_blocks(window):
    steps, num_blocks = 10, 9
    run = Run(window, num_blocks=num_blocks)  # fits only if dropped blocks go back to the pool and get reused
    prefill_then_decode(run, LENS, steps)
    tables = run.tables(range(3))
    assert sum(len(t) for t in tables) == sum(cdiv(n + steps, BS) for n in LENS) > num_blocks - 1
    assert all(t[0] == NULL_BLOCK for t in tables), tables


@pytest.mark.parametrize(
    "window, cap, sinks",
    [(None, None, None), (3, None, None), (None, 1.5, None), (None, None, SINKS)],
    ids=["full", "window3", "softcap", "sinks"],
)
def test_legacy_layout_matches_paged(window, cap, sinks):
    paged, legacy = (Run(window, cap, legacy=flag, sinks=sinks) for flag in (False, True))
    order = [2, 0, 1]  # request 2 gets legacy row 0, so rows differ from request ids
    a, b = (prefill_then_decode(r, LENS, steps=5, order=order) for r in (paged, legacy))
    assert legacy.kv.block_tables([0, 1, 2]) == {"legacy": [[1], [2], [0]]}
    assert legacy.layer.k_cache.shape == (4, MAX_LEN, KV * D)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)


def test_cache_holds_written_kv_at_mapped_slots():
    run = Run()
    run.step({"a": 6, "b": 3})
    run.step({"a": 1, "b": 1})
    assert run.tables(["a", "b"]) == [[1, 2], [3]]
    (_, ka, va, _), (_, kb, vb, _) = run.hist["a"], run.hist["b"]
    for cache, xa, xb in ((run.layer.k_cache, ka, kb), (run.layer.v_cache, va, vb)):
        assert torch.equal(cache[1], xa[:4]) and torch.equal(cache[2, :3], xa[4:7])
        assert torch.equal(cache[3], xb[:4])
        assert not cache[2, 3:].any() and not cache[4:].any()  # nothing else was written


def _prefill(run: Run, tokens: int) -> ForwardMetaData:
    assert run.kv.allocate_slots("r", 0, tokens)
    return metadata(True, [tokens], [0], run.tables(["r"]), BS, run.group)


def test_keys_with_another_head_count_than_cached_are_refused_by_name():
    run = Run()
    run.layer.prefix = "model.layers.0.self_attn.attn"
    md, wide = (
        _prefill(run, 3),
        run.randn(3, 2 * KV * D),
    )  # keys repeated after the cache update, as jetmoe does
    with pytest.raises(
        UserError, match=r"model.layers.0.self_attn.attn receives keys with 4 heads but caches 2"
    ):
        run.layer(run.randn(3, H * D), wide, wide, md)


def test_a_layer_run_twice_on_one_cache_in_one_forward_is_refused():
    run = Run()
    md, (q, k, v) = _prefill(run, 3), (run.randn(3, n * D) for n in (H, KV, KV))
    run.layer(q, k, v, md)
    with pytest.raises(UserError, match="ran twice on one cache in one forward pass"):
        run.layer(q, k, v, md)  # a looped (recurrent-depth) layer would overwrite its own cache entries


def test_a_looped_layer_keeps_a_cache_per_key():
    """A recurrent-depth model applies a layer once per loop, each pass with a cache of its own (`cache_key`):
    the probe forward collects the keys, each key gets its entry, and each pass attends over its own history."""
    layer, gen = Attention(H, D, SCALE, KV), torch.Generator().manual_seed(3)
    model = nn.ModuleDict({"attn": layer})
    probe = metadata(True, [1], [0], [[NULL_BLOCK]], BS, layer.cache_group)
    probe.probe = True
    layer.k_cache = layer.v_cache = torch.zeros(2, BS, KV, D)
    for key in (0, 4, 4):  # the probe neither checks nor sizes: it records
        layer(*(torch.randn(1, n * D) for n in (H, KV, KV)), probe, cache_key=key)
    layer.set_cache_keys(sorted(probed_cache_keys(probe)[id(layer)]))
    info = cache_info_of(model, torch.float32)
    assert [e.name for e in info.entries] == ["attn", "attn.cache_key4"]
    kv = KVCacheManager(info, 16, BS)
    for holder in (layer, *layer.more_caches):
        holder.k_cache, holder.v_cache = torch.zeros(16, BS, KV, D), torch.zeros(16, BS, KV, D)
    hist = {key: [torch.empty(0, n, D) for n in (H, KV, KV)] for key in (0, 4)}
    for computed, new in [(0, 5), (5, 1), (6, 1)]:  # a prefill, then two decode steps
        assert kv.allocate_slots("r", computed, new)
        table = kv.block_tables(["r"])[layer.cache_group]
        md = metadata(computed == 0, [new], [computed], table, BS, layer.cache_group)
        for key in (0, 4):
            q, k, v = (torch.randn(new, n, D, generator=gen) for n in (H, KV, KV))
            hist[key] = [torch.cat([h, x]) for h, x in zip(hist[key], (q, k, v))]
            out = layer(q.flatten(1), k.flatten(1), v.flatten(1), md, cache_key=key)
            ref = naive(*hist[key], range(computed, computed + new))
            torch.testing.assert_close(out.view(new, H, D).double(), ref, atol=1e-5, rtol=0)
        with pytest.raises(UserError, match="cache_key 9, which the engine's start-up forward did not use"):
            layer(q.flatten(1), k.flatten(1), v.flatten(1), md, cache_key=9)


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the portable path runs instead")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("window", "cap", "sinks"), [(None, None, None), (5, None, None), (None, 2.0, None), (5, None, SINKS)]
)
@pytest.mark.parametrize("dim", [D, 64], ids=["dim-at-run-time", "dim-compiled-in"])
@pytest.mark.parametrize("copies", [1, 4], ids=["per-kv-head", "per-request"])
def test_host_decode_kernel_is_built_and_matches_the_reference(dtype, window, cap, sinks, dim, copies):
    """The tests above run decode through the C++ kernel where it builds; here it must, reading scattered
    blocks of three requests (one a single token) in place; with more requests than threads it takes whole
    requests as work items, and a head size of 64 runs its compiled-in variant."""
    kernel = host_decode_attention()
    assert kernel is not None
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(9, BS, KV, dim, generator=gen), torch.randn(9, BS, KV, dim, generator=gen)
    q = torch.randn(3 * copies, H, dim, generator=gen)
    table = torch.tensor([[7, 2, 0], [3, 0, 0], [4, 8, 6]]).repeat(copies, 1)
    lens = torch.tensor([6, 1, 12]).repeat(copies)
    got = kernel(
        q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), table, lens, SCALE, window or 0, cap or 0.0, sinks
    )
    for b, n in enumerate(lens.tolist()):
        ctx_k, ctx_v = (c[table[b]].reshape(-1, KV, dim)[:n] for c in (k_cache, v_cache))
        q_hist = torch.zeros(n, H, dim)
        q_hist[-1] = q[b]
        expected = naive(q_hist, ctx_k, ctx_v, [n - 1], window, cap, sinks)[0]
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got[b].double(), expected, atol=tol, rtol=tol)


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the portable path runs instead")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize(("block_size", "window", "sinks"), [(40, None, None), (128, 100, SINKS)])
def test_host_decode_kernel_over_long_contexts(dtype, dim, block_size, window, sinks):
    """Contexts of many tiles (the AVX-512 loops take 16 cached tokens at a time): whole and partial tiles, a
    block size that is not a multiple of 16, one-token and 300-token requests, a sliding window starting mid-tile."""
    kernel = host_decode_attention()
    assert kernel is not None
    gen = torch.Generator().manual_seed(5)
    lens = torch.tensor([1, 17, 300, 129, 47])
    blocks = [-(-n // block_size) for n in lens.tolist()]
    order = torch.randperm(sum(blocks) + 2, generator=gen)
    table = torch.zeros(len(lens), max(blocks), dtype=torch.long)
    for b, taken in enumerate(blocks):
        table[b, :taken], order = order[:taken], order[taken:]
    k_cache, v_cache = (torch.randn(sum(blocks) + 2, block_size, KV, dim, generator=gen) for _ in range(2))
    q = torch.randn(len(lens), H, dim, generator=gen)
    got = kernel(
        q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), table, lens, SCALE, window or 0, 0.0, sinks
    )
    for b, n in enumerate(lens.tolist()):
        ctx_k, ctx_v = (c.to(dtype)[table[b]].reshape(-1, KV, dim)[:n] for c in (k_cache, v_cache))
        q_hist = torch.zeros(n, H, dim)
        q_hist[-1] = q[b].to(dtype)
        expected = naive(q_hist, ctx_k, ctx_v, [n - 1], window, None, sinks)[0]
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got[b].double(), expected, atol=tol, rtol=tol)


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the portable path runs instead")
@pytest.mark.parametrize("dim", [D, 64], ids=["dim-at-run-time", "dim-compiled-in"])
def test_a_nan_in_the_cache_reaches_the_heads_that_read_it(dim):
    """As in SDPA: a NaN key makes its KV head's query heads NaN, and no other head."""
    kernel = host_decode_attention()
    gen = torch.Generator().manual_seed(4)
    k_cache, v_cache = torch.randn(4, BS, KV, dim, generator=gen), torch.randn(4, BS, KV, dim, generator=gen)
    k_cache[1, 2, 0, 5] = float("nan")  # block 1, offset 2, kv head 0
    out = kernel(
        torch.randn(1, H, dim, generator=gen),
        k_cache,
        v_cache,
        torch.tensor([[2, 1]]),
        torch.tensor([7]),
        SCALE,
        0,
        0.0,
        None,
    )
    group = H // KV
    assert out[0, :group].isnan().all() and not out[0, group:].isnan().any()


@pytest.mark.parametrize("legacy", [False, True], ids=["paged", "legacy"])
def test_values_narrower_than_keys(legacy):
    """MLA with its keys and values expanded per head: values of another head size than keys."""
    run = Run(3, legacy=legacy, dv=D // 2)
    prefill_then_decode(run, LENS, steps=4)
    assert run.layer.v_cache.shape[-1] == (KV * D // 2 if legacy else D // 2)


def test_values_of_another_head_size_than_cached_are_refused_by_name():
    run = Run()
    md = _prefill(run, 3)  # the HF layout migrated models use: 2 * D per query / key head, D per value
    q, k, v = run.randn(1, H, 3, 2 * D), run.randn(1, KV, 3, 2 * D), run.randn(1, KV, 3, D)
    with pytest.raises(
        UserError,
        match=r"receives keys \[2, 32\] and values \[2, 16\] per token .* caches keys \[2, 16\] and values "
        r"\[2, 16\]. Set `Attention\(head_dim=..., v_head_dim=...\)`",
    ):
        run.layer(q, k, v, md)


@pytest.mark.parametrize(
    ("sinks", "dv"), [(None, D), (SINKS, D), (None, D // 2)], ids=["plain", "sinks", "dv"]
)
def test_portable_decode_path_matches_naive(monkeypatch, sinks, dv):
    """Where the C++ kernel cannot be built decode gathers the context for SDPA."""
    monkeypatch.setattr("runtime.layers.attention.host_decode_attention", lambda: None)
    prefill_then_decode(Run(3, sinks=sinks, dv=dv), LENS, steps=4)


@pytest.mark.parametrize("legacy", [False, True], ids=["paged", "legacy"])
def test_kv_heads_tiled_over_the_query_heads(legacy):
    """JetMoE tiles its keys (`k.repeat(1, n, 1, 1)`): query head h reads kv head h % KV, sinks per query head."""
    prefill_then_decode(Run(3, legacy=legacy, sinks=SINKS, tiled=True), LENS, steps=4)


def test_a_stale_kernel_build_lock_is_removed(tmp_path):
    """A build killed midway leaves its lock behind, on which torch would wait forever."""
    fresh, stale = tmp_path / "fresh", tmp_path / "stale"
    fresh.touch(), stale.touch()
    old = time.time() - STALE_LOCK_S - 1
    os.utime(stale, (old, old))
    _drop_stale_lock(fresh), _drop_stale_lock(stale), _drop_stale_lock(tmp_path / "absent")
    assert fresh.exists() and not stale.exists()


@pytest.mark.parametrize(
    "values, absorbed",
    [(lambda x: x, True), (lambda x: x + 0.5, False), (torch.tanh, False)],
    ids=["linear", "biased", "nonlinear"],
)
@pytest.mark.parametrize(
    "window, cap", [(None, None), (3, None), (None, 2.0)], ids=["full", "window3", "cap2"]
)
@pytest.mark.parametrize("legacy", [False, True])
def test_latent_cache_holds_latents_and_matches_expanded_keys_and_values(
    legacy, window, cap, values, absorbed
):
    """forward_latent (MLA): the cache holds each token's latents (two parts, one row) and nothing else; prefill
    expands them into keys and values per token, decode too where the expansion is not linear, and attends
    over the latent rows themselves where it is (absorbed: expand never runs on the context); both match
    attention over the expanded history, in a sliding window or with capped scores too."""
    parts, dv = (12, 4), 8
    latent = sum(parts)
    gen = torch.Generator().manual_seed(3)
    w_k, w_v = torch.randn(latent, KV * D, generator=gen), torch.randn(parts[0], KV * dv, generator=gen)
    layer_expanded = []

    def expand(nope, rope):  # [B, 1, S, d] each -> keys [B, KV, S, D] (rope part too), values [B, KV, S, dv]
        k = (torch.cat([nope, rope], -1) @ w_k).unflatten(-1, (KV, D))[:, 0].transpose(1, 2)
        return k, values(nope @ w_v).unflatten(-1, (KV, dv))[:, 0].transpose(1, 2)

    def counted(*latents):  # the layer's expansions, counted
        layer_expanded.append(latents)
        return expand(*latents)

    layer = Attention(H, D, SCALE, KV, window, cap, legacy=legacy, v_head_dim=dv, latent_dim=latent)
    assert layer.cache_shapes == ((1, latent), (1, 0))
    if legacy:
        kv = LegacyCacheRows(4, MAX_LEN)
        layer.k_cache, layer.v_cache = torch.zeros(4, MAX_LEN, latent), torch.zeros(4, MAX_LEN, 0)
    else:
        info = ModelCacheInfo([CacheEntry("attn", 1, latent, torch.float32, window, 0)])
        assert info.bytes_per_block(BS) == BS * latent * 4
        kv = KVCacheManager(info, 64, BS)
        layer.k_cache, layer.v_cache = torch.zeros(64, BS, 1, latent), torch.zeros(64, BS, 1, 0)
    group = layer.cache_group
    hist: dict = {}
    for step, new in enumerate([dict(enumerate(LENS)), *[dict.fromkeys(range(len(LENS)), 1)] * 3]):
        rids, lens = list(new), list(new.values())
        computed = [len(hist[r][1]) if r in hist else 0 for r in rids]
        for r, c, n in zip(rids, computed, lens):
            assert kv.allocate_slots(r, c, n)
        md = metadata(step == 0, lens, computed, kv.block_tables(rids)[group], kv.block_size, group)
        T = sum(lens)
        q, lat = torch.randn(T, H, D, generator=gen), torch.randn(T, latent, generator=gen)
        nope, rope = (x[None, None] for x in lat.split(parts, -1))
        layer_expanded.clear()
        out = layer.forward_latent(q.transpose(0, 1)[None], (nope, rope), counted, md)[0]
        assert bool(layer_expanded) == (step == 0 or not absorbed)
        for r, c, n, a in zip(rids, computed, lens, md.actual_seq_lengths_cu_q.tolist()):
            h = hist.setdefault(r, [q[:0], lat[:0]])
            h[:] = [torch.cat([x, y[a : a + n]]) for x, y in zip(h, (q, lat))]
            k, v = (x[0].transpose(0, 1) for x in expand(*(y[None, None] for y in h[1].split(parts, -1))))
            torch.testing.assert_close(
                out[a : a + n].double(), naive(h[0], k, v, range(c, c + n), window, cap), atol=1e-5, rtol=0
            )
    assert layer.v_cache.numel() == 0


@pytest.mark.parametrize("bias, linear", [(0.0, True), (0.5, False)], ids=["linear", "biased"])
def test_a_bfloat16_expansion_is_told_linear_within_its_rounding(bias, linear):
    """The linearity probe of absorbed decode compares within bfloat16's rounding: a linear expansion computed
    in bfloat16 is absorbed, one with a bias is not."""
    gen = torch.Generator().manual_seed(0)
    w_k, w_v = (torch.randn(64, KV * n, generator=gen).bfloat16() for n in (D, 32))

    def expand(x):
        return tuple((x @ w + bias).unflatten(-1, (KV, -1))[:, 0].transpose(1, 2) for w in (w_k, w_v))

    layer = Attention(H, D, SCALE, KV, v_head_dim=32, latent_dim=64)
    layer.k_cache, layer.v_cache = torch.zeros(8, BS, 1, 64, dtype=torch.bfloat16), torch.zeros(8, BS, 1, 0)
    md = metadata(True, [3], [0], [[1]], BS, layer.cache_group)
    q, lat = torch.randn(1, H, 3, D).bfloat16(), torch.randn(1, 1, 3, 64).bfloat16()
    layer.forward_latent(q, (lat,), expand, md)
    assert layer.latent_linear is linear
    assert (layer.latent_to_key is None) is not linear


@pytest.mark.parametrize("batched", [True, False], ids=["B-H-T-D", "BH-T-D"])
def test_heads_first_layout_matches_the_packed_one(batched):
    """Attention written out by hand keeps q / k / v heads first ([B, H, T, D], or [B*H, T, D] for bmm) on both
    sides of `forward_heads_first`; the result equals the packed call's on the same tokens."""
    packed, heads_first = Run(), Run()
    md_packed, md_heads_first = _prefill(packed, 5), _prefill(heads_first, 5)
    q, k, v = (packed.randn(5, n, D) for n in (H, KV, KV))
    expected = packed.layer(q.flatten(1), k.flatten(1), v.flatten(1), md_packed).view(5, H, D)
    first = [x.transpose(0, 1)[None] if batched else x.transpose(0, 1) for x in (q, k, v)]
    out = heads_first.layer.forward_heads_first(*first, md_heads_first)
    assert out.shape == first[0].shape
    torch.testing.assert_close(out.reshape(H, 5, D).transpose(0, 1), expected)


@pytest.mark.parametrize("window", [None, 3], ids=["full", "window3"])
@pytest.mark.parametrize("legacy", [False, True], ids=["paged", "legacy"])
def test_alibi_biases_prefill_and_decode_by_distance(window, legacy):
    """ALiBi (bloom, mpt): slope[h] * (key position - query position) joins the scores; decode takes the gathered
    path (the C++ kernel has no bias)."""
    prefill_then_decode(Run(window, legacy=legacy, alibi=alibi_slopes(H, scale=0.5)), LENS, steps=4)


@pytest.mark.parametrize(
    "lens, window, extent, legacy, tiled",
    [
        (LENS, None, 3, False, False),
        (RUNS, 4, 3, False, False),
        (LENS, None, 40, False, False),
        (LENS, None, 3, True, False),
        (LENS, None, 5, False, True),
    ],
    ids=["extent3", "extent3-window4-runs", "wider-than-contexts", "legacy", "tiled"],
)
def test_a_bias_by_distance_joins_each_querys_scores(lens, window, extent, legacy, tiled):
    """Inkling's relative position bias: per query token and head, a table of biases by backward distance, column
    d joining the score of the key d positions back, none from the table's width on; prefill and decode (the
    gathered path: the C++ kernel has no bias)."""
    prefill_then_decode(Run(window, legacy=legacy, tiled=tiled, distance=extent), lens, steps=5)


@pytest.mark.parametrize(
    "lens, window, legacy, tiled",
    [(LENS, None, False, False), (RUNS, 3, False, False), (LENS, None, True, False), (LENS, 3, False, True)],
    ids=["paged", "same-length-runs-window3", "legacy", "tiled"],
)
def test_a_sink_per_query_token_joins_its_softmax(lens, window, legacy, tiled):
    """Inkling2's sinks, computed from each token's hidden states: one logit per query token and head joins that
    query's softmax; decode takes the gathered path (the C++ kernel takes one per head)."""
    prefill_then_decode(Run(window, legacy=legacy, tiled=tiled, query_sinks=True), lens, steps=5)


def test_a_bias_by_distance_of_other_heads_is_refused():
    run = Run(distance=3)
    q, k, v = run.randn(4, H, D), run.randn(4, KV, D), run.randn(4, KV, D)
    with pytest.raises(
        UserError, match="takes a distance bias per query token and head \\[4, 8\\] .*, not \\[4, 2\\]"
    ):
        run.layer(q, k, v, _prefill(run, 4), distance_bias=torch.zeros(4, KV, 3))


def test_distance_positions_give_column_d_at_distance_d():
    md = metadata(False, [1, 1], [6, 2], [[1, 2], [3]], BS, "full")
    queries, keys = distance_positions(md)
    assert queries.tolist() == [6, 6] and (queries[:, None] - keys[None, :])[0].tolist() == list(range(7))


@pytest.mark.parametrize("legacy", [False, True], ids=["paged", "legacy"])
def test_a_layer_on_another_s_cache_reads_and_writes_it(legacy):
    """Falcon computes attention with ALiBi or without on one cache: the ALiBi layer is built with
    `cache_of=` the other, declares no cache of its own, and reads and writes the other's."""
    run = Run(legacy=legacy, alibi=alibi_slopes(H, scale=0.5))
    owner = Attention(H, D, 1.0, KV, legacy=legacy)
    owner.k_cache, owner.v_cache = run.layer.k_cache, run.layer.v_cache
    run.layer = Attention(
        H, D, SCALE, KV, legacy=legacy, alibi_slopes=alibi_slopes(H, scale=0.5), cache_of=owner
    )
    assert run.layer.k_cache is None and run.layer.cache_unit is None and run.group == owner.cache_group
    prefill_then_decode(run, LENS, steps=3)
    assert [
        e.name for e in cache_info_of(nn.ModuleDict({"a": owner, "b": run.layer}), torch.float32).entries
    ] == ["a"]
    with pytest.raises(UserError, match="shares the cache of .* give both the same heads"):
        Attention(H, D, SCALE, KV, sliding_window=3, cache_of=owner)


def test_alibi_slopes_follow_the_paper_for_any_head_count():
    assert alibi_slopes(8) == [2.0**-i for i in range(1, 9)]
    assert alibi_slopes(4, scale=2.0) == [2 * 2.0 ** (-2 * i) for i in range(1, 5)]
    # 6 heads: the 4-head sequence, then the odd terms of the 8-head one
    assert alibi_slopes(6) == [2.0 ** (-2 * i) for i in range(1, 5)] + [2.0**-1, 2.0**-3]
    with pytest.raises(UserError, match="has 8 heads but 4 ALiBi slopes"):
        Attention(H, D, SCALE, KV, alibi_slopes=alibi_slopes(4))


@pytest.mark.parametrize(
    "lens, legacy", [(LENS, False), (RUNS, False), (LENS, True)], ids=["paged", "same-length-runs", "legacy"]
)
def test_a_query_reads_only_the_positions_an_indexer_picked(lens, legacy):
    """Sparse attention (DeepSeek's DSA): `selected` [B, Lq, k] positions of each request's context row; prefill
    masks each run's fresh tokens, decode takes the gathered path over the block table's slots."""
    prefill_then_decode(Run(legacy=legacy, picks=3), lens, steps=5)


@pytest.mark.parametrize(
    "lens, legacy", [(LENS, False), (RUNS, False), (LENS, True)], ids=["paged", "same-length-runs", "legacy"]
)
def test_a_query_reads_only_the_blocks_its_heads_indexer_picked(lens, legacy):
    """MiniMax-M3's sparse attention: [B, groups, Lq, k] picks of blocks of 3 positions (-1: none), one pick per
    group of query heads; each head reads only its group's blocks."""
    prefill_then_decode(Run(legacy=legacy, picks=2, pick_block=3, pick_groups=KV), lens, steps=5)


@pytest.mark.parametrize(
    "rank, shares, groups", [(1, 2, [2, 3]), (0, 4, [0]), (3, 8, [1])], ids=["two", "one", "part_of_one"]
)
def test_picks_per_group_of_heads_are_cut_to_a_layers_share_of_the_heads(rank, shares, groups):
    """Under attention TP a layer computes a contiguous share of the heads: of picks for 4 groups of the 8, the
    share's own groups, or the one its heads are part of."""
    layer = Attention(H // shares, D, SCALE, max(KV // shares, 1), head_share=(rank, shares))
    picks = torch.arange(4)[None, :, None, None].expand(2, 4, 3, 5)
    assert layer._picks(picks).indices[0, :, 0, 0].tolist() == groups
    with pytest.raises(UserError, match="one of 3 shares of the query heads"):
        Attention(2, D, SCALE, 1, head_share=(0, 3))._picks(picks)


def test_picks_that_do_not_split_the_heads_into_groups_are_refused():
    run = Run(picks=2, pick_groups=3)
    with pytest.raises(UserError, match="do not split into the 3 consecutive groups"):
        run.step({0: 4})


def test_latent_attention_reads_only_the_positions_an_indexer_picked():
    """forward_latent with `selected` equals the same picks over keys and values expanded up front."""
    latent, layer = Attention(H, D, SCALE, KV, latent_dim=KV * 2 * D), Run(picks=2)
    latent.k_cache, latent.v_cache = torch.zeros(64, BS, 1, KV * 2 * D), torch.zeros(64, BS, 1, 0)
    expand = lambda kv: kv.unflatten(-1, (KV, 2 * D))[:, 0].transpose(1, 2).split(D, -1)
    for new in ({0: 5, 1: 3}, {0: 1, 1: 1}, {0: 1, 1: 1}):
        gen = torch.Generator().manual_seed(len(layer.hist) + sum(new.values()))
        rids, lens = list(new), list(new.values())
        computed = [len(layer.hist[r][1]) if r in layer.hist else 0 for r in rids]
        for r, c, n in zip(rids, computed, lens):
            assert layer.kv.allocate_slots(r, c, n)
        md = metadata(not computed[0], lens, computed, layer.tables(rids), BS, layer.group)
        q, kv = torch.randn(sum(lens), H, D, generator=gen), torch.randn(sum(lens), KV * 2 * D, generator=gen)
        picks = layer.pick(md, computed)
        k, v = (x[0].transpose(0, 1) for x in expand(kv[None, None]))
        expected = layer.layer(q, k, v, md, selected=picks).view(-1, H, D)
        md._cache.clear()
        out = latent.forward_latent(q.transpose(0, 1)[None], (kv[None, None],), expand, md, selected=picks)
        torch.testing.assert_close(out[0], expected, atol=1e-5, rtol=0)
        for r, c, n in zip(rids, computed, lens):
            layer.hist.setdefault(r, [None, torch.empty(c + n)])[1] = torch.empty(c + n)


@pytest.mark.parametrize(
    "lens, window, keep, legacy, tied",
    [
        (LENS, None, None, False, False),
        (RUNS, 4, None, False, False),
        (LENS, None, 4, False, False),
        (RUNS, 3, 2, False, False),
        (LENS, None, 4, True, False),
        (LENS, None, 4, False, True),
    ],
    ids=["bias", "bias-window", "keep4", "keep2-window", "keep4-legacy", "keep4-ties"],
)
def test_a_bias_per_key_joins_its_scores_and_keeps_the_largest(lens, window, keep, legacy, tied):
    """Doge's dynamic mask: a bias per key token and key head joins every score of that key, cached as one more
    key channel; past `keep` visible keys a query reads only the `keep` of the largest bias, in prefill and in
    decode (the C++ kernel reads the bias channel while no context holds more)."""
    prefill_then_decode(Run(window, legacy=legacy, key_bias=True, keep=keep, tied=tied), lens, steps=6)


def test_a_key_bias_is_refused_where_it_cannot_join_the_scores():
    with pytest.raises(UserError, match="keep_keys\\) but has no key_bias"):
        Attention(H, D, SCALE, KV, keep_keys=4)
    with pytest.raises(UserError, match="neither soft_cap nor latent_dim"):
        Attention(H, D, SCALE, KV, soft_cap=5.0, key_bias=True)
    for run, bias in ((Run(key_bias=True), None), (Run(), torch.zeros(4, KV))):
        q, k, v = run.randn(4, H, D), run.randn(4, KV, D), run.randn(4, KV, D)
        with pytest.raises(UserError, match="pass `key_bias=` on every call"):
            run.layer(q, k, v, _prefill(run, 4), key_bias=bias)
    run = Run(key_bias=True)
    with pytest.raises(UserError, match="takes a key bias per token and key head \\[4, 2\\], not \\[4, 8\\]"):
        run.layer(q, k, v, _prefill(run, 4), key_bias=torch.zeros(4, H))


@pytest.mark.parametrize("kind", [{"window": 3}, {"keep": 2}], ids=["sliding_window", "keep_keys"])
def test_picks_are_refused_by_a_layer_masking_keys_its_own_way(kind):
    run = Run(picks=2, **kind)
    with pytest.raises(UserError, match="only a layer without a sliding window or keep_keys shares"):
        run.step({0: 4})


def test_a_model_holding_no_attention_layer_is_told_why_it_gets_no_cache():
    with pytest.raises(UserError, match="holds no runtime Attention layer"):
        cache_info_of(nn.ModuleDict({"mlp": nn.Linear(2, 2)}), torch.float32)


def test_distance_columns_hold_the_distance_of_their_column():
    md = metadata(True, [3, 5], [0, 0], [[1], [2, 3]], BS, "full")
    assert distance_columns(md).tolist() == [list(range(5))] * 8


def test_stack_attention_is_transformers_eager_attention_without_a_mask():
    from transformers.models.inkling2.modeling_inkling2 import eager_attention_forward

    gen = torch.Generator().manual_seed(0)
    q, kv = torch.randn(2, 5, 3, 16, generator=gen), torch.randn(2, 5, 4, 16, generator=gen)
    module = nn.Module()
    module.num_key_value_groups, module.training = 1, False
    expected, _ = eager_attention_forward(module, q, kv, kv, None, scaling=0.25)
    torch.testing.assert_close(stack_attention(q, kv, kv, 0.25).transpose(1, 2), expected)
