"""Collectives for layers: every function is a no-op when the group is None (a single-rank group)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

if TYPE_CHECKING:
    from runtime.config.comm_manager import CommManager

# Newer torch renamed the flat-tensor collectives; torch_npu pins releases that only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def tp_info(comm_manager: CommManager | None, tp_group: str | None) -> tuple[int, int, ProcessGroup | None]:
    """(size, rank, group) of `tp_group`; a layer without that group (or None) runs unsharded."""
    if comm_manager is None or not comm_manager.has_group(tp_group):
        return 1, 0, None
    return comm_manager.get_size(tp_group), comm_manager.get_rank(tp_group), comm_manager.get_group(tp_group)


def all_reduce(t: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sums `t` in place across the group."""
    if group is not None:
        dist.all_reduce(t, group=group)
    return t


def all_gather(t: torch.Tensor, group: ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """Concatenates every rank's `t` along `dim`, in group-rank order (contiguous)."""
    if group is None:
        return t
    local = t.movedim(dim, 0).contiguous()
    out = local.new_empty((dist.get_world_size(group) * local.shape[0], *local.shape[1:]))
    _all_gather_flat(out, local, group=group)
    return out.movedim(0, dim).contiguous()


def reduce_scatter(t: torch.Tensor, group: ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """Sums `t` across the group; each rank keeps its own equal chunk along `dim` (contiguous)."""
    if group is None:
        return t
    full = t.movedim(dim, 0).contiguous()
    world = dist.get_world_size(group)
    assert full.shape[0] % world == 0, (
        f"dim {dim} of size {full.shape[0]} not divisible by group size {world}"
    )
    out = full.new_empty((full.shape[0] // world, *full.shape[1:]))
    _reduce_scatter_flat(out, full, group=group)
    return out.movedim(0, dim).contiguous()
