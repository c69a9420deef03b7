"""The attention output projection in a TP group of its own (seed 002's ``o_proj_tp_size``, ``oproj_tp_group``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from runtime.config.comm_manager import OPROJ_GROUP
from runtime.layers.comm import all_gather, reduce_scatter
from runtime.layers.linear import RowParallelLinear
from runtime.layers.quantization.base import UnquantizedLinearMethod
from runtime.layers.token_layout import ATTN_GROUP, current_layout, pad_rows

if TYPE_CHECKING:
    from runtime.config.comm_manager import CommManager


class OProjParallelLinear(RowParallelLinear):
    """o_proj split by input columns (whole heads). Without a registered ``tp_group`` it is attention's
    RowParallelLinear in attn_tp_group, whose partial sums the attention's TPRegion reduces. With one (its size a
    multiple of attn_tp_size, its ranks whole attention TP groups, as the consecutive layout makes them), attention
    runs data-parallel across it: each rank holds its attention TP share of the heads for all tokens of its DP
    rank. The layer gathers its group's attention outputs, takes its block of head columns for every token of the
    group, multiplies, and reduce-scatters the sums back to each rank's chunk of rows."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        comm_manager: CommManager | None = None,
        tp_group: str = OPROJ_GROUP,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
        quant_method: UnquantizedLinearMethod | None = None,
        transposed_on_disk: bool = False,
    ):
        self.gathers_tokens = comm_manager is not None and comm_manager.has_group(tp_group)
        super().__init__(
            input_size,
            output_size,
            bias,
            reduce_results=False,
            comm_manager=comm_manager,
            tp_group=tp_group if self.gathers_tokens else ATTN_GROUP,
            params_dtype=params_dtype,
            prefix=prefix,
            quant_method=quant_method,
            transposed_on_disk=transposed_on_disk,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gathers_tokens:
            return super().forward(x)
        layout = current_layout()
        assert layout.sharded, "oproj_tp_group needs attention DP in lock-step"
        a, o = layout.attn_tp_size, self.tp_size
        # [o, R, W / a] by group rank (DP-major, then attention TP rank): every DP rank's tokens, padded alike
        parts = all_gather(pad_rows(x, layout.rows * a), self.group, dim=-2).unflatten(-2, (o, -1))
        # the attention TP rank holding this rank's block of heads, and the block's place among its heads
        holder, at = divmod(self.tp_rank, o // a)
        mine = parts.unflatten(-3, (o // a, a)).select(-3, holder)  # [DP ranks, R, W / a]
        tokens = mine.narrow(-1, at * self.shard.size, self.shard.size).flatten(-3, -2)
        out, finish = self.quant_method.apply_partial(self, tokens)
        out = reduce_scatter(finish(out), self.group, dim=-2)  # this rank's rows of its DP rank, summed
        out = out if self.bias is None else out + self.bias
        if a == 1:
            return out
        # the attention's TPRegion reduce-scatters over attn_tp_group: one rank of it holds each chunk of rows
        return F.pad(
            out, (0, 0, layout.attn_tp_rank * layout.rows, (a - 1 - layout.attn_tp_rank) * layout.rows)
        )
