"""Vocab-parallel embedding and LM head: vocab rows split across ranks, padded with zero rows."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from runtime.errors import ConfigError
from runtime.layers.comm import all_gather, all_reduce, reduce_scatter
from runtime.layers.linear import LoadedWeight, ShardId, TPModule, check_shape, read_narrow
from runtime.layers.quantization.base import UNQUANTIZED
from runtime.layers.token_layout import current_layout, pad_rows

if TYPE_CHECKING:
    from runtime.config.comm_manager import CommManager


class VocabParallelEmbedding(TPModule):
    """The vocab is padded to a multiple of pad_to * tp; each rank holds padded / tp consecutive rows."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        comm_manager: CommManager | None = None,
        tp_group: str = "embed_tp_group",
        pad_to: int = 64,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
    ):
        super().__init__(prefix, params_dtype, comm_manager, tp_group)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        multiple = pad_to * self.tp_size
        self.padded_num_embeddings = -(-num_embeddings // multiple) * multiple
        self.shard_size = self.padded_num_embeddings // self.tp_size
        self.shard_start = self.tp_rank * self.shard_size
        self._add_param("weight", self.shard_size, embedding_dim)

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: ShardId = None) -> None:
        """Copies this shard's real vocab rows; padding rows become zero. Also loads a [vocab] bias."""
        assert shard_id is None, f"{param.param_name} takes no shard_id, got {shard_id!r}"
        check_shape(param, loaded, (self.num_embeddings, *param.shape[1:]), tuple(param.shape))
        real = max(0, min(self.shard_size, self.num_embeddings - self.shard_start))
        if real:
            param.data[:real].copy_(read_narrow(loaded, 0, self.shard_start, real))
        param.data[real:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Replicated layout: look up the ids, sum the shards. Sharded layout (ids are this rank's chunk): look
        up the whole group's ids, reduce_scatter back to the chunks."""
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        sharded = current_layout().sharded
        if sharded:
            ids = all_gather(ids, self.group, dim=-1)
        local = ids - self.shard_start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return reduce_scatter(out, self.group, dim=-2) if sharded else all_reduce(out, self.group)


class ParallelLMHead(VocabParallelEmbedding):
    """logits = hidden @ weight.T per vocab shard, gathered over the group and trimmed to the real vocab."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        comm_manager: CommManager | None = None,
        tp_group: str = "lmhead_tp_group",
        pad_to: int = 64,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
    ):
        super().__init__(num_embeddings, embedding_dim, comm_manager, tp_group, pad_to, params_dtype, prefix)
        self._add_bias(bias, self.shard_size)
        self.quant_method = UNQUANTIZED

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Replicated layout: logits of the same rows on every rank. Sharded layout (attention-DP ranks hold
        different rows): the group's rows are gathered, and each rank keeps its own rows' full logits."""
        layout = current_layout()
        # a group inside one attn-TP group (consecutive ranks, tp | attn_tp) already shares its rows
        if not layout.sharded or layout.attn_tp_size % self.tp_size == 0:
            logits = all_gather(self.quant_method.apply(self, hidden, self.bias), self.group, dim=-1)
            return logits[..., : self.num_embeddings]
        n = hidden.shape[-2]
        most = int(all_gather(torch.tensor([n], device=hidden.device), self.group, dim=0).max())
        rows = all_gather(pad_rows(hidden, most), self.group, dim=-2)
        logits = all_gather(self.quant_method.apply(self, rows, self.bias), self.group, dim=-1)
        return logits[..., self.tp_rank * most : self.tp_rank * most + n, : self.num_embeddings].contiguous()

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        """Shares the embedding's weight; both layers must shard the vocab identically."""
        mine = (self.tp_size, self.tp_rank, tuple(self.weight.shape))
        if (embedding.tp_size, embedding.tp_rank, tuple(embedding.weight.shape)) != mine:
            raise ConfigError(
                f"tied embeddings need the same vocab shards in {embedding.tp_group_name} (size {embedding.tp_size}, "
                f"shard {list(embedding.weight.shape)}) and {self.tp_group_name} (size {self.tp_size}, shard "
                f"{list(self.weight.shape)}): embed_tp_size and lmhead_tp_size must be equal (or untie the LM head)"
            )
        self.weight = embedding.weight
