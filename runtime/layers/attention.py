"""Attention over packed variable-length requests, with the KV cache owned by the layer.

Prefill: each request attends causally to its own fresh tokens (prompts are packed back to
back in ``[T]``). Decode: one query per request reads its context through the block table; on the host a
C++ kernel reads the cache in place (elsewhere, and inside a compiled graph, the context is gathered for SDPA).
The cache is written by ``slot_mapping`` in both phases. The legacy ``cache_unit`` layout is the
same mechanism with one block of ``max_seq_len`` slots per batch row.
"""

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runtime.engine.forward_metadata import ForwardMetaData
from runtime.errors import UserError
from runtime.kernels import BUILT, host_decode_attention

LEGACY = "legacy"


def alibi_slopes(num_heads: int, scale: float = 1.0) -> list[float]:
    """ALiBi's head slopes (Press et al.), times scale: 2^(-8i/n) for i = 1..n with n the largest power of two up
    to num_heads, then, for the heads beyond n, every other term of that sequence for 2n (the odd ones)."""
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = [2 ** (-8 * i / n) for i in range(1, n + 1)]
    slopes += [2 ** (-8 * i / (2 * n)) for i in range(1, 2 * (num_heads - n), 2)]
    return [s * scale for s in slopes]


def cache_group_key(sliding_window: int | None) -> str:
    return f"sliding_window_{sliding_window}" if sliding_window else "full"


def _prefill_runs(md: ForwardMetaData) -> list[tuple[int, int, int]]:
    """(first packed token, requests, fresh tokens each) of every run of consecutive requests of one length
    (read to the host once per step)."""

    def build():
        runs, start = [], 0
        for length, same in itertools.groupby(md.actual_seq_lengths_q.tolist()):
            count = len(list(same))
            runs.append((start, count, length))
            start += count * length
        return runs

    return md.memo("prefill_runs", build)


def causal_mask(md: ForwardMetaData, length: int, window: int | None) -> torch.Tensor:
    """[L, L] boolean mask: causal, inside the window."""

    def build():
        i = torch.arange(length, device=md.positions.device)
        allowed = i[None, :] <= i[:, None]
        if window:
            allowed &= i[None, :] > i[:, None] - window
        return allowed

    return md.memo(("causal_mask", length, window), build)


def _distances(md: ForwardMetaData, length: int) -> torch.Tensor:
    """[L, L] key position minus query position, for ALiBi over a prefill run."""

    def build():
        i = torch.arange(length, device=md.positions.device, dtype=torch.float32)
        return i[None, :] - i[:, None]

    return md.memo(("distances", length), build)


def _decode_distances(md: ForwardMetaData, num_slots: int) -> torch.Tensor:
    """[B, 1, 1, S] key position minus each request's query position (its context's last), for ALiBi decode."""

    def build():
        j = torch.arange(num_slots, device=md.positions.device, dtype=torch.float32)[None, :]
        return (j - (md.actual_seq_lengths_kv[:, None] - 1))[:, None, None, :]

    return md.memo(("decode_distances", num_slots), build)


def decode_mask(md: ForwardMetaData, window: int | None, num_slots: int) -> torch.Tensor:
    """[B, 1, 1, S] boolean mask over the gathered context of each request."""

    def build():
        j = torch.arange(num_slots, device=md.positions.device)[None, :]
        kv = md.actual_seq_lengths_kv[:, None]
        allowed = j < kv
        if window:
            allowed &= j > kv - 1 - window
        return allowed[:, None, None, :]

    return md.memo(("decode_mask", window, num_slots), build)


def stack_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention within each token's own stack of states, nothing masked and nothing cached (Inkling2's block
    attention residual: learned queries over the outputs of earlier blocks): q [..., Lq, D], k / v [..., Lk, D]
    -> [..., Lq, D], as transformers' eager attention computes it."""
    weights = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scale, dim=-1, dtype=torch.float32)
    return torch.matmul(weights.to(q.dtype), v)


def distance_positions(md: ForwardMetaData) -> tuple[torch.Tensor, torch.Tensor]:
    """(query positions [T], key positions [D]) at which a relative position bias, one that reads the
    positions only as query minus key, gives the table ``Attention(distance_bias=)`` takes: every query at D - 1,
    key d at D - 1 - d, so column d is distance d. D is the longest distance a query of this step reaches."""
    device = md.positions.device
    distances = max(md.max_seq_len_kv, md.max_seq_len_q, 1)
    return (
        torch.full((md.num_tokens,), distances - 1, device=device),
        torch.arange(distances - 1, -1, -1, device=device),
    )


def distance_columns(md: ForwardMetaData) -> torch.Tensor:
    """[T, D]: every query's distances to ``distance_positions``' keys, column d holding d; what a relative position
    bias module that gathers a table by the distances it is given reads to yield ``Attention(distance_bias=)``'s."""
    queries, keys = distance_positions(md)
    return queries[:, None] - keys[None, :]


@dataclass(frozen=True)
class ScoreBias:
    """What joins the scaled scores besides the mask: ALiBi's ``slopes`` [H] (``slope[h] * (key position - query
    position)``) and ``by_distance`` [T, H, D], one bias per query token, head and backward distance (column d
    for the key d positions before the query, zero from D on: a relative position bias conditioned on the query,
    as Inkling's)."""

    slopes: torch.Tensor | None = None
    by_distance: torch.Tensor | None = None

    def at(self, first: int, count: int, length: int, key_minus_query: torch.Tensor) -> torch.Tensor:
        """The bias of ``count`` requests of ``length`` queries each, from packed token ``first``, at the keys'
        relative positions (``key_minus_query`` broadcast to [count, 1, length, keys]) -> [count, H, length, keys]."""
        bias = 0.0
        if self.slopes is not None:
            bias = self.slopes.float().view(1, -1, 1, 1) * key_minus_query
        if self.by_distance is not None:
            table = (
                self.by_distance[first : first + count * length].unflatten(0, (count, length)).transpose(1, 2)
            )
            distance = (-key_minus_query).long()
            inside = (distance >= 0) & (distance < table.shape[-1])
            index = distance.clamp(0, table.shape[-1] - 1).expand(*table.shape[:3], distance.shape[-1])
            bias = bias + table.float().gather(-1, index).masked_fill(~inside, 0.0)
        return bias

    def by_head_groups(self, kv_heads: int) -> "ScoreBias":
        """The bias with its query heads reordered as ``_tiled_to_grouped`` orders them."""
        slopes, table = self.slopes, self.by_distance
        return ScoreBias(
            None if slopes is None else _tiled_to_grouped(slopes[None, :, None], kv_heads)[0, :, 0],
            None if table is None else _tiled_to_grouped(table, kv_heads),
        )


@dataclass(frozen=True)
class Picks:
    """What a sparse-attention indexer picked in each request's context (``index_cache.by_request``'s layout:
    prefill, the request's fresh tokens; decode, the slots of its block table): ``indices`` [B, Lq, k] for every
    query head (DeepSeek's DSA), or [B, h, Lq, k], k picks for each group of ``num_heads / h`` query heads
    (MiniMax-M3's, one group per key head). Each is a position, or with ``block`` > 1 the block of ``block``
    positions it numbers (position // block); a negative one, or one past the keys, picks nothing."""

    indices: torch.Tensor
    block: int
    num_heads: int

    def of_requests(self, first: int, count: int) -> "Picks":
        return dataclasses.replace(self, indices=self.indices[first : first + count])

    def mask(self, num_keys: int) -> torch.Tensor:
        """[B, 1 | H, Lq, num_keys] boolean: which of the first num_keys keys each query may read."""
        picks = self.indices.long() if self.indices.dim() == 4 else self.indices.long()[:, None]
        blocks = -(-num_keys // self.block)
        picks = picks.masked_fill((picks < 0) | (picks >= blocks), blocks)  # into a spare column, dropped
        shape = (*picks.shape[:-1], blocks + 1)
        hit = torch.zeros(shape, dtype=torch.bool, device=picks.device).scatter_(-1, picks, True)[
            ..., :blocks
        ]
        if self.block > 1:
            hit = hit.repeat_interleave(self.block, -1)[..., :num_keys]
        return hit if hit.shape[1] == 1 else hit.repeat_interleave(self.num_heads // hit.shape[1], 1)


def _kept(bias: torch.Tensor, allowed: torch.Tensor, keep: int, num_heads: int) -> torch.Tensor:
    """Of the keys each query may read (``allowed`` [B | 1, 1, Lq, S]), the ``keep`` with the largest key bias
    (``bias`` [B, Hkv, S], any positive multiple of it) per key head -> [B, H, Lq, S] boolean. Of equal biases
    (a token repeated, in a first layer) the earlier keys are kept, in prefill and decode alike."""
    scores = bias[:, :, None, :].float().masked_fill(~allowed, -math.inf)
    top = scores.sort(dim=-1, descending=True, stable=True).indices[..., :keep]
    kept = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(-1, top, True) & allowed
    return kept.repeat_interleave(num_heads // bias.shape[1], 1)


def _sdpa(q, k, v, mask, scale, soft_cap, sinks, bias=None):
    """q [B, H, Lq, D], k/v [B, Hkv, Lk, D], sinks [H] or [B, H, Lq] (one per query) or None, bias
    (``ScoreBias.at``'s) or None -> [B, H, Lq, D]."""
    if soft_cap is None and sinks is None and bias is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)).float() * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if sinks is None:
        return torch.softmax(scores, dim=-1).to(q.dtype) @ v
    sink = sinks.float().view(1, -1, 1, 1) if sinks.dim() == 1 else sinks.float()[..., None]
    sink = sink.expand(*scores.shape[:-1], 1)  # one more logit, no value row
    return torch.softmax(torch.cat([scores, sink], -1), dim=-1)[..., :-1].to(q.dtype) @ v


def _prefill(
    q, k, v, md, scale, sliding_window, soft_cap, sinks, bias=None, picks=None, keep=None
) -> torch.Tensor:
    """Each request's fresh tokens attend causally to each other: q [T, H, D], k/v [T, Hkv, D | Dv] -> [T, H, Dv];
    ``picks``: only the fresh tokens an indexer picked for each query (``Picks``); ``keep``: only
    the keys with the largest bias, read off the keys' last channel (``Attention(key_bias=True)``).

    Consecutive requests of one length run as one batch, nothing padded: padding every request to the longest
    one and masking it costs the longest one's work per request and keeps SDPA from skipping the future (the
    bench's mixed64 prefill, one layer: 450 -> 172 ms)."""
    outs, first = [], 0  # first: the run's first request
    for start, count, length in _prefill_runs(md):
        qi, ki, vi = (
            x[start : start + count * length].unflatten(0, (count, length)).transpose(1, 2) for x in (q, k, v)
        )
        kept = keep is not None and length > keep
        plain = soft_cap is None and sinks is None and not sliding_window and bias is None and not kept
        if plain and picks is None:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
        else:
            scores_bias = None if bias is None else bias.at(start, count, length, _distances(md, length))
            mask = causal_mask(md, length, sliding_window)
            if picks is not None:  # built per run: [count, H, length, length], not for the longest request
                mask = mask & picks.of_requests(first, count).mask(length)[:, :, :length]
            if kept:
                mask = _kept(ki[..., -1], mask.expand(count, 1, length, length), keep, qi.shape[1])
            o = _sdpa(qi, ki, vi, mask, scale, soft_cap, _run_sinks(sinks, start, count, length), scores_bias)
        outs.append(o.transpose(1, 2).flatten(0, 1))
        first += count
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _run_sinks(sinks: torch.Tensor | None, first: int, count: int, length: int) -> torch.Tensor | None:
    """The sinks of ``count`` requests of ``length`` queries each, from packed token ``first``: [H] as they are,
    [T, H] (one per query) -> [count, H, length]."""
    if sinks is None or sinks.dim() == 1:
        return sinks
    return sinks[first : first + count * length].unflatten(0, (count, length)).transpose(1, 2)


def _linear_maps(
    expand: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    sizes: Sequence[int],
    like: torch.Tensor,
    num_heads: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What ``expand`` does to one latent row, per query head: ([H, latent, D], [H, latent, Dv]), read off the
    rows of an identity; None unless it is linear: zero to zero exactly, and three random rows to their products
    with the maps (within the dtype's rounding)."""
    width = sum(sizes)
    gen = torch.Generator().manual_seed(0)
    probes = torch.randn(3, width, generator=gen).to(like)
    rows = torch.cat([torch.eye(width, dtype=like.dtype, device=like.device), probes, probes[:1] * 0])
    with torch.no_grad():
        keys, values = (x[0] for x in expand(*(x[None, None] for x in rows.split(list(sizes), dim=-1))))
    tol = 1e-4 if like.dtype in (torch.float32, torch.float64) else 3e-2
    for got in (keys, values):
        want = probes.float() @ got[:, :width].float()
        if got[:, -1].any() or (got[:, width:-1].float() - want).abs().max() > tol * want.abs().max():
            return None
    groups = num_heads // keys.shape[0]
    return tuple(x[:, :width].repeat_interleave(groups, 0).contiguous() for x in (keys, values))


def _decode_kernel() -> Callable | None:
    if torch.compiler.is_compiling():  # compile_decode built it before tracing
        return BUILT.get("paged_decode_attention")
    return host_decode_attention()


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: ForwardMetaData,
    group: str,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    bias: ScoreBias | None = None,
    picks: Picks | None = None,
    keep: int | None = None,
) -> torch.Tensor:
    """q [T, H, D], k [T, Hkv, D], v [T, Hkv, Dv], caches [blocks, block_size, Hkv, D | Dv], sinks [H] or [T, H], a bias on
    the scores (``ScoreBias``), an indexer's picks (``Picks``), the keys to keep by their bias (``_kept``)
    -> [T, H, Dv]."""
    kv_heads, head_dim, v_head_dim = k_cache.shape[2], k_cache.shape[3], v_cache.shape[3]
    slots = md.slot_mapping[group]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, kv_heads, v_head_dim).index_copy_(0, slots, v)
    if md.is_prefill:
        return _prefill(q, k, v, md, scale, sliding_window, soft_cap, sinks, bias, picks, keep)
    table = md.block_table[group]
    kept = keep is not None and md.max_seq_len_kv > keep  # a context holds more keys
    host = q.device.type == "cpu" and bias is None and picks is None and q.dtype != torch.float64
    host &= not kept and (sinks is None or sinks.dim() == 1)  # the kernel takes one sink per head
    if host and (kernel := _decode_kernel()):
        return kernel(
            q.contiguous(),
            k_cache,
            v_cache,
            table,
            md.actual_seq_lengths_kv,
            scale,
            sliding_window or 0,
            soft_cap or 0.0,
            sinks,
        )
    B = table.shape[0]
    ctx_k = k_cache[table].view(B, -1, kv_heads, head_dim).transpose(1, 2)
    ctx_v = v_cache[table].view(B, -1, kv_heads, v_head_dim).transpose(1, 2)
    mask = decode_mask(md, sliding_window, ctx_k.shape[2])
    if picks is not None:
        mask = mask & picks.mask(ctx_k.shape[2])
    if kept:
        mask = _kept(ctx_k[..., -1], mask, keep, q.shape[1])
    scores_bias = None if bias is None else bias.at(0, B, 1, _decode_distances(md, ctx_k.shape[2]))
    sinks = _run_sinks(sinks, 0, B, 1)
    return _sdpa(q[:, :, None], ctx_k, ctx_v, mask, scale, soft_cap, sinks, scores_bias)[:, :, 0]


def _tiled_to_grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[T, H, D] with head t * kv_heads + j reading kv head j -> head j * (H // kv_heads) + t."""
    T, H, D = x.shape
    return x.view(T, H // kv_heads, kv_heads, D).transpose(1, 2).reshape(T, H, D)


def _grouped_to_tiled(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    T, H, D = x.shape
    return x.view(T, kv_heads, H // kv_heads, D).transpose(1, 2).reshape(T, H, D)


def probed_cache_keys(md: ForwardMetaData) -> dict[int, set[int]]:
    """The cache keys each attention layer (by id of its cache owner) was called with in a probe forward."""
    return md.memo("attention_cache_keys", dict)


class CacheSlot:
    """One more cache of a layer that keeps several (a ``cache_key`` each)."""

    def __init__(self) -> None:
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None


class Attention(nn.Module):
    """Multi-head / grouped-query attention that owns its slice of the KV cache.

    The engine binds ``k_cache`` / ``v_cache`` after sizing the pool. With ``legacy=True`` the
    layer declares ``cache_unit`` instead and the engine preallocates a
    ``[max_batch, max_seq_len, *cache_unit]`` cache on it (the seeds' legacy path).

    A layer applied several times in one forward pass (recurrent-depth models loop over their layers) passes a
    ``cache_key`` per application, as transformers offsets the layer index it gives ``cache.update``; it keeps
    a cache per key. The engine collects the keys on a dummy forward at start (``set_cache_keys``).
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int | None = None,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        legacy: bool = False,
        prefix: str = "",
        v_head_dim: int | None = None,
        latent_dim: int | None = None,
        kv_heads_tiled: bool = False,
        alibi_slopes: Sequence[float] | None = None,
        cache_of: "Attention | None" = None,
        key_bias: bool = False,
        keep_keys: int | None = None,
        select_block: int = 1,
        head_share: tuple[int, int] = (0, 1),
    ):
        """``kv_heads_tiled``: query head h reads key / value head ``h % num_kv_heads`` (keys tiled with
        ``.repeat``, as JetMoE does) instead of ``h // (num_heads // num_kv_heads)``. ``alibi_slopes``: ALiBi,
        a bias of ``slope[h] * (key position - query position)`` added to head h's scaled scores.
        ``key_bias``: forward takes a bias per key token and key head that joins every score of that key (Doge's
        dynamic mask); it is cached as one more key channel, which a query channel of ``1 / scale`` reads.
        ``keep_keys``: a query whose context holds more keys reads only the ``keep_keys`` with the largest bias.
        ``select_block``: an indexer's picks (``forward``'s ``selected``) number blocks of this many positions.
        ``head_share``: (rank, shares) under attention TP, this layer's heads being that contiguous share of the
        model's; picks per group of heads are cut to the share's groups.
        ``cache_of``: read and write that layer's cache instead of owning one (Falcon computes attention with
        or without ALiBi on one cache: one forward runs one of the two)."""
        super().__init__()
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        self.num_kv_heads = num_kv_heads or num_heads
        self.v_head_dim = v_head_dim or head_dim  # values may be narrower than keys (MLA)
        self.sliding_window, self.soft_cap, self.prefix = sliding_window, soft_cap, prefix
        self.latent_dim = latent_dim  # cached per token instead of keys and values (forward_latent)
        # absorbed decode (forward_latent): whether the expansion is linear, None until the first prefill reads it
        # off; then per query head, latent row -> its key and value ([H, latent_dim, D], [H, latent_dim, Dv])
        self.latent_linear: bool | None = None
        self.register_buffer("latent_to_key", None, persistent=False)
        self.register_buffer("latent_to_value", None, persistent=False)
        self.kv_heads_tiled = kv_heads_tiled and self.num_kv_heads != num_heads
        self.key_bias, self.keep_keys, self.select_block = key_bias, keep_keys, select_block
        self.head_share = head_share
        self._check_key_bias()
        self._shared = () if cache_of is None else (cache_of,)  # a tuple: not a submodule of this layer
        if cache_of is not None and (cache_of.cache_shapes, cache_of.sliding_window) != (
            self.cache_shapes,
            sliding_window,
        ):
            raise UserError(
                f"Attention layer {prefix or '(unnamed)'} shares the cache of {cache_of.prefix or 'a layer'} "
                f"but caches {self.cache_shapes} per token (window {sliding_window}), not "
                f"{cache_of.cache_shapes} (window {cache_of.sliding_window}): give both the same heads, "
                "head sizes and sliding window."
            )
        k_unit, v_unit = self.cache_shapes
        self.cache_unit = (math.prod(k_unit),) if legacy and not self._shared else None
        self.v_cache_unit = (math.prod(v_unit),) if legacy and not self._shared else None
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.cache_keys: tuple[int, ...] = (0,)  # the first reads and writes k_cache / v_cache
        self.more_caches: tuple[CacheSlot, ...] = ()  # one for each further key
        if alibi_slopes is not None and len(alibi_slopes) != num_heads:
            raise UserError(
                f"Attention layer {prefix or '(unnamed)'} has {num_heads} heads but {len(alibi_slopes)} ALiBi "
                "slopes: each head needs its own (under attention TP a rank holds a share of the heads; ALiBi "
                "is not split by `skill parallelize`)."
            )
        slopes = None if alibi_slopes is None else torch.tensor(alibi_slopes, dtype=torch.float32)
        self.register_buffer("alibi_slopes", slopes, persistent=False)

    @property
    def cache_owner(self) -> "Attention":
        """The layer whose cache this one reads and writes: itself unless built with ``cache_of``."""
        return self._shared[0] if self._shared else self

    def set_cache_keys(self, keys: Sequence[int]) -> None:
        if len(keys) > 1 and self.cache_unit:
            raise UserError(
                f"Attention layer {self.prefix or '(unnamed)'} keeps a cache for each of the keys {list(keys)} "
                "(a layer applied in a loop), which only the paged KV layout gives: drop "
                "`custom_params.kv_layout: legacy`."
            )
        self.cache_keys = tuple(keys)
        self.more_caches = tuple(CacheSlot() for _ in keys[1:])

    def _caches(self, md: ForwardMetaData, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The owner's cache for ``key``; the engine's probe forward records the key instead (and writes the
        first cache, as its dummy token may)."""
        owner = self.cache_owner
        if md.probe:
            probed_cache_keys(md).setdefault(id(owner), set()).add(key)
            return owner.k_cache, owner.v_cache
        if md.is_prefill and not torch.compiler.is_compiling():
            self._check_runs_once(md, key)
        if key == owner.cache_keys[0]:
            return owner.k_cache, owner.v_cache
        if key not in owner.cache_keys:
            raise UserError(
                f"Attention layer {self.prefix or '(unnamed)'} is called with cache_key {key}, which the engine's "
                f"start-up forward did not use (it sized caches for {list(owner.cache_keys)}): the keys must not "
                "depend on the input."
            )
        slot = owner.more_caches[owner.cache_keys.index(key) - 1]
        return slot.k_cache, slot.v_cache

    @property
    def cache_group(self) -> str:
        owner = self.cache_owner
        return LEGACY if owner.cache_unit else cache_group_key(owner.sliding_window)

    @property
    def cache_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """([heads, size] of the key cache, [heads, size] of the value cache) per token: one latent row and no
        values for a latent cache."""
        if self.latent_dim:
            return (1, self.latent_dim), (1, 0)
        return (self.num_kv_heads, self.key_width), (self.num_kv_heads, self.v_head_dim)

    @property
    def key_width(self) -> int:
        """What the cache holds per key head: its keys, then its bias (``key_bias``)."""
        return self.head_dim + self.key_bias

    def forward_latent(
        self,
        q: torch.Tensor,
        latents: tuple[torch.Tensor, ...],
        expand: Callable[..., tuple[torch.Tensor, torch.Tensor]],
        md: ForwardMetaData,
        cache_key: int = 0,
        selected: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Multi-head latent attention over a cache of the latents themselves (HF layout, as migrated models call
        it): q [1, H, T, D], latents [1, 1, T, d_i] whose widths sum to ``latent_dim``, and ``expand(*latents)``
        -> keys [.., Hkv, S, D] and values [.., Hkv, S, Dv] per token (DeepSeek's ``expand_kv``) -> [1, T, H, Dv].
        ``selected``: the context positions an indexer picked for each query (``forward``).

        Each step writes the fresh tokens' latents; prefill expands those (no per-head keys or values are ever
        stored). Decode absorbs the expansion into the query and the output instead, when ``expand`` is linear:
        a score q . (W_k x) is (W_k^T q) . x, so every head attends over the cached latent rows x themselves and
        its output W_v (sum_s p_s x_s) is expanded once, not each context token's keys and values at every step.
        The maps W_k, W_v are read off ``expand`` at the first prefill (the engine's start-up probe, before it
        sizes the KV pool again); a nonlinear expansion (a bias, a norm) is decompressed over the whole context
        instead."""
        picks = self._picks(selected)
        sizes = [x.shape[-1] for x in latents]
        if md.is_prefill and not torch.compiler.is_compiling():
            if sum(sizes) != self.latent_dim:
                raise UserError(
                    f"Attention layer {self.prefix or '(unnamed)'} receives latents of widths {sizes} per token "
                    f"but caches {self.latent_dim}. Set `Attention(latent_dim=...)` in the modeling file to "
                    "their sum."
                )
            if self.latent_linear is None:
                maps = _linear_maps(expand, sizes, latents[0], q.shape[1])
                self.latent_linear = maps is not None
                self.latent_to_key, self.latent_to_value = maps or (None, None)
        context = self._latent_context(md, cache_key, torch.cat([x[0, 0] for x in latents], dim=-1))
        if md.is_prefill:
            k, v = (x[0].transpose(0, 1) for x in expand(*latents))
            q = q[0].transpose(0, 1)
            return _prefill(q, k, v, md, self.scale, self.sliding_window, self.soft_cap, None, None, picks)[
                None
            ]
        q = q[0].transpose(0, 1)[:, :, None]  # [B, H, 1, D]
        mask = decode_mask(md, self.sliding_window, context.shape[1])
        if picks is not None:
            mask = mask & picks.mask(context.shape[1])
        if self.latent_linear:
            # one head of H queries [B, 1, H, latent_dim] over the cached rows [B, 1, S, latent_dim]
            rows, q = context[:, None], (q @ self.latent_to_key.transpose(-1, -2)).transpose(1, 2)
            o = _sdpa(q, rows, rows, mask.transpose(1, 2), self.scale, self.soft_cap, None).transpose(1, 2)
            return (o @ self.latent_to_value)[:, :, 0][None]
        k, v = expand(*(x[:, None] for x in context.split(sizes, dim=-1)))
        o = _sdpa(q, k, v, mask, self.scale, self.soft_cap, None)
        return o[:, :, 0][None]

    def _latent_context(
        self, md: ForwardMetaData, cache_key: int, fresh: torch.Tensor
    ) -> torch.Tensor | None:
        """Writes the fresh tokens' rows [T, latent_dim] at their slots; in decode returns each request's cached
        rows [B, S, latent_dim] over its block table's slots (prefill reads only the fresh ones: None)."""
        k_cache = self._caches(md, cache_key)[0]
        assert k_cache is not None, f"{self.prefix}: KV cache was never bound by the engine"
        group, rows = self.cache_group, k_cache.view(-1, self.latent_dim)
        rows.index_copy_(0, md.slot_mapping[group], fresh)
        if md.is_prefill:
            return None
        return rows.view(-1, k_cache.shape[1], self.latent_dim)[md.block_table[group]].flatten(1, 2)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        md: ForwardMetaData,
        sinks: torch.Tensor | None = None,
        cache_key: int = 0,
        selected: torch.Tensor | None = None,
        key_bias: torch.Tensor | None = None,
        distance_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Packed: q [T, H*D] or [T, H, D] (k/v with Hkv heads, v of head size Dv) -> [T, H*Dv].

        HF layout, as migrated models call it: q [1, H, T, D], k/v [1, Hkv, T, D | Dv] -> [1, T, H, Dv].
        ``sinks`` [H]: a learned logit per query head that joins each softmax's denominator (GPT-OSS); or one per
        query token and head, [T, H] (HF layout [1, H, T, 1]: Inkling2 computes them from the hidden states).
        ``cache_key``: which of the layer's caches this application reads and writes (class docstring).
        ``selected``: sparse attention, each query reads only what an indexer picked in its request's context
        (``Picks``: DeepSeek's DSA picks positions, MiniMax-M3 blocks of ``select_block`` per key head).
        ``key_bias`` [T, Hkv] (HF layout [1, Hkv, T]): added to every score of the key, for a layer built with
        ``key_bias=True``.
        ``distance_bias`` [T, H, D] (HF layout [1, H, T, D]): column d is added to the query's score of the key d
        positions before it, for d < D (``distance_positions`` gives the D a step needs).
        """
        picks = self._picks(selected)
        if q.dim() == 4:
            q, k, v = (x[0].transpose(0, 1) for x in (q, k, v))
            key_bias, distance_bias = (
                None if x is None else x[0].transpose(0, 1) for x in (key_bias, distance_bias)
            )
            sinks = sinks[0, ..., 0].transpose(0, 1) if sinks is not None and sinks.dim() == 4 else sinks
            return self._attend(q, k, v, md, sinks, cache_key, picks, key_bias, distance_bias)[None]
        T = q.shape[0]
        q = q.view(T, -1, self.head_dim)
        k = k.view(T, -1, self.head_dim)
        v = v.view(T, -1, self.v_head_dim)
        return self._attend(q, k, v, md, sinks, cache_key, picks, key_bias, distance_bias).reshape(T, -1)

    def forward_heads_first(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: ForwardMetaData, cache_key: int = 0
    ) -> torch.Tensor:
        """The layout attention written out by hand keeps on both sides (migrated models call it): q [1, H, T, D]
        or [H, T, D], k / v alike with Hkv heads -> [1, H, T, Dv] or [H, T, Dv]."""
        heads_first = q.shape[:-1]
        q, k, v = (x.reshape(-1, *x.shape[-2:]).transpose(0, 1) for x in (q, k, v))
        return self._attend(q, k, v, md, None, cache_key).transpose(0, 1).reshape(*heads_first, -1)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        md: ForwardMetaData,
        sinks: torch.Tensor | None,
        cache_key: int,
        picks: Picks | None = None,
        key_bias: torch.Tensor | None = None,
        distance_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = self._caches(md, cache_key)
        assert k_cache is not None, f"{self.prefix}: KV cache was never bound by the engine"
        if md.is_prefill and not torch.compiler.is_compiling():
            self._check_fits_cache(k, v)
        if self.key_bias != (key_bias is not None):
            raise UserError(
                f"Attention layer {self.prefix or '(unnamed)'} is built with key_bias={self.key_bias} but called "
                f"{'without' if self.key_bias else 'with'} one: pass `key_bias=` on every call of a layer built "
                "with `key_bias=True`, and only then."
            )
        if key_bias is not None:  # q . k + bias / scale as (q, 1 / scale) . (k, bias), scaled
            if key_bias.shape != k.shape[:2]:
                raise UserError(
                    f"Attention layer {self.prefix or '(unnamed)'} takes a key bias per token and key head "
                    f"{list(k.shape[:2])}, not {list(key_bias.shape)}: compute it per key head (HF layout "
                    "[1, heads, tokens]), before any repeat to the query heads."
                )
            k = torch.cat([k, key_bias.to(k.dtype)[..., None]], -1)
            q = torch.cat([q, q.new_full((*q.shape[:-1], 1), 1 / self.scale)], -1)
        if distance_bias is not None and distance_bias.shape[:2] != q.shape[:2]:
            raise UserError(
                f"Attention layer {self.prefix or '(unnamed)'} takes a distance bias per query token and head "
                f"{list(q.shape[:2])} (then one per distance), not {list(distance_bias.shape[:2])}: compute it "
                "per query head (HF layout [1, heads, tokens, distances])."
            )
        shape = (-1, k_cache.shape[1], self.num_kv_heads)
        bias = None
        if self.alibi_slopes is not None or distance_bias is not None:
            bias = ScoreBias(self.alibi_slopes, distance_bias)
        if self.kv_heads_tiled:  # run grouped: query heads reordered so that each group shares its kv head
            q = _tiled_to_grouped(q, self.num_kv_heads)
            if sinks is not None:  # one per head [H], or per query token [T, H]
                grouped = _tiled_to_grouped(sinks.view(-1, sinks.shape[-1], 1), self.num_kv_heads)
                sinks = grouped.view(sinks.shape)
            bias = None if bias is None else bias.by_head_groups(self.num_kv_heads)
        o = attend(
            q,
            k.contiguous(),
            v.contiguous(),
            k_cache.view(*shape, self.key_width),
            v_cache.view(*shape, self.v_head_dim),
            md,
            self.cache_group,
            self.scale,
            self.sliding_window,
            self.soft_cap,
            sinks,
            bias,
            picks,
            self.keep_keys,
        )
        return _grouped_to_tiled(o, self.num_kv_heads) if self.kv_heads_tiled else o

    def _check_key_bias(self) -> None:
        where = f"Attention layer {self.prefix or '(unnamed)'}"
        if self.keep_keys is not None and not self.key_bias:
            raise UserError(f"{where} keeps the keys with the largest bias (keep_keys) but has no key_bias.")
        if self.key_bias and (self.soft_cap is not None or self.latent_dim):
            raise UserError(
                f"{where}: a key bias joins the scores after a soft cap, and is not cached with latents; build "
                "it with key_bias=True and neither soft_cap nor latent_dim."
            )

    def _picks(self, selected: torch.Tensor | None) -> Picks | None:
        if selected is None:
            return None
        where = f"Attention layer {self.prefix or '(unnamed)'}"
        if self.sliding_window or self.keep_keys is not None:
            raise UserError(
                f"{where} reads the positions an indexer selected in its context, which only a layer without a "
                "sliding window or keep_keys shares with the indexer's key cache."
            )
        rank, shares = self.head_share
        groups = selected.shape[1] if selected.dim() == 4 else 1
        if groups > 1 and shares > 1 and not (groups % shares == 0 or shares % groups == 0):
            raise UserError(
                f"{where} computes one of {shares} shares of the query heads, which the {groups} groups an "
                f"indexer picks for ({list(selected.shape)}) do not split evenly: set attn_tp_size to a divisor or "
                "a multiple of the groups."
            )
        if groups > 1 and shares > 1:  # this share's groups: several, or a part of one
            first, count = rank * groups // shares, max(groups // shares, 1)
            selected, groups = selected[:, first : first + count], count
        if self.num_heads % groups or (groups > 1 and self.kv_heads_tiled):
            raise UserError(
                f"{where}: its {self.num_heads} query heads{' (tiled over their key heads)' if self.kv_heads_tiled else ''} "
                f"do not split into the {groups} consecutive groups an indexer picks for ({list(selected.shape)}): "
                "pick per key head, or once for every head ([batch, queries, k])."
            )
        return Picks(selected, self.select_block, self.num_heads)

    def _check_fits_cache(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Refuse by name what this layer's cache cannot hold; checked on eager prefill steps."""
        where = f"Attention layer {self.prefix or '(unnamed)'}"
        if k.shape[1] != self.num_kv_heads:
            raise UserError(
                f"{where} receives keys with {k.shape[1]} heads but caches {self.num_kv_heads}: the model "
                "code computes its key heads in a way the migrator did not follow (for example repeating "
                "keys after the cache update). Set `Attention(num_kv_heads=...)` in the modeling file to "
                "the key tensor's head count."
            )
        if (k.shape[-1], v.shape[1], v.shape[-1]) != (self.head_dim, self.num_kv_heads, self.v_head_dim):
            raise UserError(
                f"{where} receives keys {list(k.shape[1:])} and values {list(v.shape[1:])} per token "
                f"([heads, head_dim]) but caches keys [{self.num_kv_heads}, {self.head_dim}] and values "
                f"[{self.num_kv_heads}, {self.v_head_dim}]. Set `Attention(head_dim=..., v_head_dim=...)` in "
                "the modeling file to the key and value head sizes."
            )

    def _check_runs_once(self, md: ForwardMetaData, key: int) -> None:
        seen, cache = md.memo("attention_caches_written", set), (id(self.cache_owner), key)
        if cache in seen:
            raise UserError(
                f"Attention layer {self.prefix or '(unnamed)'} ran twice on one cache in one forward pass (a layer "
                "applied in a loop, or two layers on one cache): the second pass would overwrite the first's keys "
                "and values. A looped layer passes a `cache_key` per application (the offset transformers adds to "
                "the layer index it gives `cache.update`); this model gives the same one twice."
            )
        seen.add(cache)


def cache_info_of(model: nn.Module, dtype: torch.dtype):
    """The paged cache entries of every ``Attention`` layer, for a model's ``get_cache_info()``: one per
    cache key of a layer applied several times in a forward pass."""
    from runtime.kv_cache import CacheEntry, ModelCacheInfo

    owners = _owners(model)
    if not owners:
        raise UserError(
            f"{type(model).__name__} holds no runtime Attention layer, so the runtime has no cache to give it: its "
            "attention is built in a way the migrator's rules do not rewrite, or it has none. Port the attention "
            "to runtime.layers.attention.Attention by hand."
        )
    return ModelCacheInfo(
        [
            CacheEntry(name, k[0], k[1], dtype, m.sliding_window, v[1])
            for m, names in owners
            for k, v in [m.cache_shapes]
            for name in names
        ]
    )


def cache_holders(model: nn.Module) -> dict[str, "Attention | CacheSlot"]:
    """What the engine binds each cache entry's tensors on, by entry name."""
    return {
        name: slot
        for m, names in _owners(model)
        for name, slot in zip(names, (m, *m.more_caches), strict=True)
    }


def _owners(model: nn.Module) -> list[tuple[Attention, list[str]]]:
    """Each attention layer that owns its cache, with an entry name per cache key: its module name, then
    ``{name}.cache_key{key}`` for each further key."""
    return [
        (m, [name] + [f"{name}.cache_key{key}" for key in m.cache_keys[1:]])
        for name, m in model.named_modules()
        if isinstance(m, Attention) and m.cache_owner is m
    ]
