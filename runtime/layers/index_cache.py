"""What a sparse-attention indexer needs from the runtime (DeepSeek's DSA: a light scorer picks, for each query,
the context tokens attention reads): a key cache of its own, and the per-request layout HF's scoring code is
written for (``[batch, tokens, ...]``: each request's fresh tokens in a row of their own).

Positions the indexer picks are positions in that row: prefill, the request's fresh tokens; decode, the slots of
its block table. ``Attention(..., selected=picks)`` reads the same layout (``Picks``)."""

from typing import Any

import torch

from runtime.engine.forward_metadata import ForwardMetaData
from runtime.errors import UserError
from runtime.layers.attention import Attention, causal_mask, decode_mask


def _request_and_offset(md: ForwardMetaData) -> tuple[torch.Tensor, torch.Tensor]:
    """[T] request index and [T] offset among its fresh tokens of every packed token."""

    def build():
        lengths = md.actual_seq_lengths_q
        request = torch.repeat_interleave(
            torch.arange(lengths.numel(), device=lengths.device), lengths, output_size=md.num_tokens
        )
        return request, torch.arange(request.numel(), device=lengths.device) - md.actual_seq_lengths_cu_q[
            request
        ]

    return md.memo("request_and_offset", build)


def by_request(x: Any, md: ForwardMetaData) -> Any:
    """HF's packed layout [1, T, ...] -> [B, Lq, ...], request b's fresh tokens in row b, zeros after them;
    tuples (cos and sin) element by element, None as it is."""
    if x is None:
        return None
    if isinstance(x, tuple):
        return tuple(by_request(e, md) for e in x)
    if not isinstance(x, torch.Tensor) or x.shape[:2] != (1, md.num_tokens):
        raise UserError(
            f"by_request takes a step's tokens in HF's layout [1, {md.num_tokens}, ...], not "
            f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}: an indexer input that is not "
            "one row per token (pass it on unchanged in the modeling file)."
        )
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
        queries score, and which of them a query may pick (its request's, up to its own position). Keys of one
        head written heads first, [B, 1, Lq, dim] (MiniMax-M3's), come back so: [B, 1, S, dim]."""
        if k.dim() == 4:
            if k.shape[1] != 1:
                raise UserError(
                    f"{self.prefix or 'An indexer key cache'} holds one key per token, not {k.shape[1]} heads "
                    f"({list(k.shape)}): share one key head among the indexer's query heads, as DSA does."
                )
            keys, visible = self.forward(k[:, 0], md)
            return keys[:, None], visible
        request, offset = _request_and_offset(md)
        context = self._latent_context(md, 0, k[request, offset])
        if md.is_prefill:
            return k, _prefill_visible(md)
        return context, decode_mask(md, None, context.shape[1])[:, 0]


def _prefill_visible(md: ForwardMetaData) -> torch.Tensor:
    """[B, Lq, Lq]: each fresh token's own request's fresh tokens up to itself (padding never)."""

    def build():
        fresh = torch.arange(md.max_seq_len_q, device=md.positions.device) < md.actual_seq_lengths_q[:, None]
        return causal_mask(md, md.max_seq_len_q, None)[None] & fresh[:, None, :]

    return md.memo("index_prefill_visible", build)
