"""Per-head parameters (attention sinks) cut to the heads this rank computes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from runtime.errors import ConfigError
from runtime.layers.comm import tp_info
from runtime.layers.linear import LoadedWeight, ShardId, check_shape, read_narrow, set_weight_attrs

if TYPE_CHECKING:
    from runtime.config.comm_manager import CommManager


def shard_heads(
    param: nn.Parameter | None, comm_manager: CommManager | None, tp_group: str
) -> nn.Parameter | None:
    """``param`` [num_heads, ...] keeping this rank's contiguous share of the query heads of ``tp_group`` (the
    heads its ``QKVParallelLinear`` computes); its loader reads only those rows from the checkpoint."""
    size, rank, _ = tp_info(comm_manager, tp_group)
    if param is None or size == 1:
        return param
    total = param.shape[0]
    if total % size:
        raise ConfigError(f"a per-head parameter of {total} heads is not divisible by {tp_group} ({size})")
    local = total // size
    shard = nn.Parameter(param.data.new_empty(local, *param.shape[1:]), requires_grad=False)

    def load(p: nn.Parameter, loaded: LoadedWeight, shard_id: ShardId = None) -> None:
        assert shard_id is None, f"a per-head parameter takes no shard_id, got {shard_id!r}"
        check_shape(p, loaded, tuple(param.shape), tuple(p.shape))
        p.data.copy_(read_narrow(loaded, 0, rank * local, local))

    set_weight_attrs(shard, weight_loader=load)
    return shard
