"""What a sparse-attention indexer needs from the runtime (DeepSeek's DSA: a light scorer picks, for each query,
the context tokens attention reads): a key cache of its own, and the per-request layout HF's scoring code is
written for (``[batch, tokens, ...]``, each request's context in its own row).

Positions the indexer picks are positions in that row: prefill, the request's fresh tokens; decode, the slots of
its block table. ``Attention(..., selected=picks)`` reads the same layout."""

import torch

from runtime.engine.forward_metadata import ForwardMetaData
from runtime.layers.attention import Attention, _decode_mask


def _request_and_offset(md: ForwardMetaData) -> tuple[torch.Tensor, torch.Tensor]:
    """[T] request index and [T] offset among its fresh tokens of every packed token."""

    def build():
        lengths = md.actual_seq_lengths_q
        request = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
        return request, torch.arange(request.numel(), device=lengths.device) - md.actual_seq_lengths_cu_q[
            request
        ]

    return md.memo("request_and_offset", build)


def by_request(x, md: ForwardMetaData):
    """HF's packed layout [1, T, ...] -> [B, Lq, ...], request b's fresh tokens in row b, zeros after them;
    tuples (cos and sin) element by element."""
    if isinstance(x, tuple):
        return tuple(by_request(e, md) for e in x)
    request, offset = _request_and_offset(md)
    out = x.new_zeros(md.batch_size, md.max_seq_len_q, *x.shape[2:])
    out[request, offset] = x[0]
    return out


class IndexKeyCache(Attention):
    """An indexer's keys, one row of ``dim`` values per token, in the paged pool beside the attention caches."""

    def __init__(self, dim: int, legacy: bool = False, prefix: str = ""):
        super().__init__(num_heads=1, head_dim=dim, scale=1.0, legacy=legacy, latent_dim=dim, prefix=prefix)

    def forward(self, k: torch.Tensor, md: ForwardMetaData) -> tuple[torch.Tensor, torch.Tensor]:
        """k [B, Lq, dim] (``by_request``) -> (keys [B, S, dim], visible [B, Lq, S]): the keys each request's
        queries score, and which of them a query may pick (its request's, up to its own position)."""
        cache = self._caches(md, 0)[0]
        assert cache is not None, f"{self.prefix}: index key cache was never bound by the engine"
        request, offset = _request_and_offset(md)
        rows, group = cache.view(-1, self.latent_dim), self.cache_group
        rows.index_copy_(0, md.slot_mapping[group], k[request, offset])
        if md.is_prefill:
            i = torch.arange(k.shape[1], device=k.device)
            fresh = i[None, :] < md.actual_seq_lengths_q[:, None]  # [B, Lq]
            return k, (i[None, :] <= i[:, None])[None] & fresh[:, None, :]
        keys = rows.view(-1, cache.shape[1], self.latent_dim)[md.block_table[group]].flatten(1, 2)
        return keys, _decode_mask(md, None, keys.shape[1])[:, 0]
