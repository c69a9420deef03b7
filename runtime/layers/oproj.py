"""The attention output projection in a TP group of its own (seed 002's ``o_proj_tp_size``, ``oproj_tp_group``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from runtime.config.comm_manager import OPROJ_GROUP
from runtime.layers.comm import all_gather, reduce_scatter
from runtime.layers.linear import RowParallelLinear
from runtime.layers.quantization.base import UnquantizedLinearMethod
from runtime.layers.token_layout import ATTN_GROUP, current_layout, pad_rows

if TYPE_CHECKING:
    from runtime.config.comm_manager import CommManager


class OProjParallelLinear(RowParallelLinear):
    """o_proj split by input columns (whole heads). Without a registered ``tp_group`` it is attention's
    RowParallelLinear in attn_tp_group, whose partial sums the attention's TPRegion reduces. With one, attention
    runs data-parallel (attn_tp_size 1: each rank holds every head of its own tokens): the layer gathers its
    group's tokens, multiplies its block of head columns and reduce-scatters the sums back to each rank's rows."""

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
        assert layout.sharded and layout.attn_tp_size == 1, "oproj_tp_group needs attention DP in lock-step"
        tokens = all_gather(pad_rows(x, layout.rows), self.group, dim=-2)
        out, finish = self.quant_method.apply_partial(
            self, tokens.narrow(-1, self.shard.src_start, self.shard.size)
        )
        out = reduce_scatter(finish(out), self.group, dim=-2)
        return out if self.bias is None else out + self.bias
