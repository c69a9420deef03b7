"""A request's KV, read out of and written into the paged cache, in a form independent of TP: every KV head.

Attention TP shards KV heads like the qkv projection does: with tp <= heads rank r holds heads
[r * heads/tp, (r + 1) * heads/tp); with tp > heads each head is replicated over tp / heads consecutive ranks.
"""

import torch

from runtime.errors import UserError

RequestKV = dict[
    str, tuple[torch.Tensor, torch.Tensor]
]  # layer name -> (k, v), each [tokens, heads, head_dim]


def head_slice(total_heads: int, tp: int, rank: int) -> slice:
    per_rank = max(total_heads // tp, 1)
    first = rank // max(tp // total_heads, 1) * per_rank
    return slice(first, first + per_rank)


def merge_heads(per_rank: list[RequestKV], total_heads: dict[str, int]) -> RequestKV:
    """Every TP rank's slice -> all heads (replicas taken once)."""
    tp, out = len(per_rank), {}
    for name, total in total_heads.items():
        owners = sorted({head_slice(total, tp, r).start: r for r in range(tp)}.items())
        out[name] = tuple(torch.cat([per_rank[r][name][i] for _, r in owners], dim=1) for i in (0, 1))
    return out


def slots(block_table: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(num_tokens)
    return torch.tensor(block_table, dtype=torch.long)[pos // block_size] * block_size + pos % block_size


class PagedKV:
    """The cache tensors of a worker's attention layers, by layer name and cache group."""

    def __init__(self, model: torch.nn.Module, kv_manager):
        if not hasattr(kv_manager, "groups"):
            raise UserError(
                "prefill-decode disaggregation needs the paged KV layout; the model uses the legacy "
                "per-request rows (custom_params.kv_layout: legacy)"
            )
        modules = dict(model.named_modules())
        self.block_size = kv_manager.block_size
        self.groups = {g: [e.name for e in entries] for g, entries in kv_manager.groups.items()}
        self.layers = {name: modules[name] for names in self.groups.values() for name in names}

    def local_heads(self) -> dict[str, int]:
        return {name: m.k_cache.shape[2] for name, m in self.layers.items()}

    def read(self, tables: dict[str, list[list[int]]], num_tokens: int) -> RequestKV:
        """This rank's heads of the first num_tokens positions, on the host."""
        out = {}
        for group, names in self.groups.items():
            at = slots(tables[group][0], num_tokens, self.block_size).to(
                next(iter(self.layers.values())).k_cache.device
            )
            for name in names:
                m = self.layers[name]
                flat = (c.view(-1, *c.shape[2:]) for c in (m.k_cache, m.v_cache))
                out[name] = tuple(c.index_select(0, at).cpu() for c in flat)
        return out

    def write(self, tables: dict[str, list[list[int]]], kv: RequestKV, tp: int, rank: int) -> None:
        """Store this rank's heads of an all-heads RequestKV into the blocks of `tables`."""
        for group, names in self.groups.items():
            for name in names:
                k, v = kv[name]
                m = self.layers[name]
                heads = head_slice(k.shape[1], tp, rank)
                at = slots(tables[group][0], k.shape[0], self.block_size).to(m.k_cache.device)
                for cache, x in ((m.k_cache, k), (m.v_cache, v)):
                    cache.view(-1, *cache.shape[2:]).index_copy_(0, at, x[:, heads].to(cache))

    def check(self, kv: RequestKV, tp: int) -> str | None:
        """Why a RequestKV cannot go into this cache (another model, head count), or None."""
        if set(kv) != set(self.layers):
            return "the prefill instance runs a model with other attention layers"
        for name, m in self.layers.items():
            k = kv[name][0]
            if k.shape[2] != m.k_cache.shape[3] or max(k.shape[1] // tp, 1) != m.k_cache.shape[2]:
                return (
                    f"{name}: {k.shape[1]} KV heads of {k.shape[2]} do not shard over TP {tp} into this cache"
                )
        return None
