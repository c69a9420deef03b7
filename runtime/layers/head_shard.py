"""Per-head parameters and modules under attention TP: a rank's head count and share of per-head values, sinks
cut to this rank's heads, a module over all heads' q or k run on every head."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

from runtime.errors import ConfigError
from runtime.layers.comm import all_gather, tp_info
from runtime.layers.linear import LoadedWeight, ShardId, check_shape, read_narrow, set_weight_attrs

if TYPE_CHECKING:
    from runtime.config.comm_manager import CommManager

T = TypeVar("T")


def local_heads(total: int, comm_manager: CommManager | None, tp_group: str) -> int:
    """The heads of ``total`` one rank of ``tp_group`` computes: the contiguous share its column-parallel
    projections produce."""
    return _even_share(total, "attention heads", comm_manager, tp_group)


def head_share(comm_manager: CommManager | None, tp_group: str) -> tuple[int, int]:
    """(rank, size) of ``tp_group``: which contiguous share of the query heads this rank computes, of how many."""
    size, rank, _ = tp_info(comm_manager, tp_group)
    return rank, size


def local_kv_heads(total: int, comm_manager: CommManager | None, tp_group: str) -> int:
    """The key heads of ``total`` one rank of ``tp_group`` holds: its share, or one replica when there are fewer
    key heads than ranks (as QKVParallelLinear lays them out)."""
    size = tp_info(comm_manager, tp_group)[0]
    if total < size and size % total == 0:
        return 1
    return _even_share(total, "key heads", comm_manager, tp_group)


def interleaved_heads(query_heads: int, key_heads: int) -> None:
    """Refuse a model whose q, k and v are interleaved per head on disk with fewer key heads than query heads: a
    rank's contiguous rows would not be its heads' (the rewrite assumed one key head per query head)."""
    if key_heads != query_heads:
        raise ConfigError(
            f"q, k and v are interleaved per head, but this model has {key_heads} key heads for {query_heads} "
            "query heads: its fused projection cannot be split by heads; run it without attention TP"
        )


def local_width(total: int, comm_manager: CommManager | None, tp_group: str) -> int:
    """The width of one rank's heads side by side, ``total`` being all heads': the attention output a rank holds
    before its row-parallel output projection."""
    return _even_share(total, "channels of the attention output", comm_manager, tp_group)


def whole_blocks(rows: int, block: int, comm_manager: CommManager | None, tp_group: str) -> None:
    """Refuse a ``tp_group`` whose ranks' contiguous shares of a fused projection's ``rows`` output channels would
    cut one of the blocks of ``block`` channels its forward views them in (CodeGen's ``qkv_proj``, q, v and k of
    a quarter of the heads per block): a rank needs whole blocks."""
    size = tp_info(comm_manager, tp_group)[0]
    if rows % (block * size):
        raise ConfigError(
            f"a projection's {rows} output channels are {rows // block} blocks of {block} (each with its own q, k "
            f"and v), which {size} ranks of {tp_group} cannot share evenly: choose a size that divides "
            f"{rows // block}"
        )


def _even_share(total: int, what: str, comm_manager: CommManager | None, tp_group: str) -> int:
    size = tp_info(comm_manager, tp_group)[0]
    if total % size:
        raise ConfigError(f"{total} {what} are not divisible by the size of {tp_group} ({size})")
    return total // size


def local_share(per_head: Sequence[T], comm_manager: CommManager | None, tp_group: str) -> list[T]:
    """This rank's contiguous share of ``per_head`` values (ALiBi slopes, one per query head): those of the heads
    ``local_heads`` counts."""
    local = local_heads(len(per_head), comm_manager, tp_group)
    rank = tp_info(comm_manager, tp_group)[1]
    return list(per_head[rank * local : (rank + 1) * local])


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


def gather_heads(
    module: nn.Module, total_heads: int, comm_manager: CommManager | None, tp_group: str
) -> nn.Module:
    """``module`` made to run on every head of an activation each rank holds only its heads of: a norm over all
    heads' q or k (OLMo2's ``q_norm`` / ``k_norm``) computed exactly under attention TP. Its input is gathered
    in head order (one copy of kv heads replicated over ranks), it runs on the whole width with its weights
    whole (their names unchanged: hooks, not a wrapper), and each rank keeps its own heads of the result."""
    size, rank, group = tp_info(comm_manager, tp_group)
    if group is None:
        return module
    replicas = max(size // total_heads, 1)  # ranks holding each head (kv heads fewer than ranks)
    local_heads = max(total_heads // size, 1)

    def gather(_: nn.Module, args: tuple) -> tuple:
        whole = all_gather(args[0], group, dim=-1)
        if replicas > 1:  # every head `replicas` times in a row: keep one of each
            whole = whole.unflatten(-1, (size, -1))[..., ::replicas, :].flatten(-2)
        return (whole, *args[1:])

    def keep_own(_: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        assert out.shape == args[0].shape, f"{type(module).__name__} changed the shape of all heads"
        width = out.shape[-1] // total_heads * local_heads
        own = rank // replicas * width
        return out[..., own : own + width]

    module.register_forward_pre_hook(gather)
    module.register_forward_hook(keep_own)
    return module
