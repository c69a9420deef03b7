"""Where a step's packed tokens live across ranks, and the re-layouts around tensor-parallel units.

Two layouts (seed 002's patterns):

* replicated (attn_dp_size == 1, or no TP at all): every rank holds all tokens of its attention-DP rank;
  a TP unit ends with an all_reduce over its own group.
* sharded (attn_dp_size > 1 and some TP size > 1): between units every rank holds ``rows`` rows: its
  attn-TP chunk of its DP rank's tokens padded to ``attn_tp_size * rows``, with ``rows`` equal on every rank
  of the world. A token-wise unit (MLP, embedding) all_gathers its group's rows in and reduce_scatters its
  partial sums out, whatever its TP degree; attention all_gathers over attn_tp_group and works on the real
  tokens of its DP rank (the TP+DP pattern). The same pair re-lays tokens out between modules whose TP
  degrees differ.

The engine sets the layout for each step (``step_layout``); without one, a step is replicated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from runtime.layers.comm import all_gather, all_reduce, reduce_scatter, tp_info

if TYPE_CHECKING:
    from runtime.config import ParallelConfig
    from runtime.config.comm_manager import CommManager

ATTN_GROUP = "attn_tp_group"


@dataclass(frozen=True)
class TokenLayout:
    sharded: bool = False
    num_tokens: int = 0  # real tokens of this DP rank this step
    rows: int = 0  # rows every rank holds between units (sharded)
    attn_tp_size: int = 1
    attn_tp_rank: int = 0
    attn_group: ProcessGroup | None = None


REPLICATED = TokenLayout()
# this step's layout: a plain global, which torch.compile traces (reading a ContextVar breaks the graph); one
# thread steps an engine
_layout = REPLICATED


def current_layout() -> TokenLayout:
    return _layout


@contextlib.contextmanager
def use_layout(layout: TokenLayout) -> Iterator[None]:
    global _layout
    saved, _layout = _layout, layout
    try:
        yield
    finally:
        _layout = saved


def needs_sharded_layout(pc: ParallelConfig) -> bool:
    """Attention DP with any TP module: DP ranks then share collectives and must step in lock-step."""
    sizes = (
        pc.attn_tp_size,
        pc.dense_tp_size,
        pc.embed_tp_size,
        pc.lmhead_tp_size,
        pc.moe_tp_size,
        pc.o_proj_tp_size,
    )  # the sizes models shard by
    return pc.attn_dp_size > 1 and max(sizes) > 1


def step_layout(
    pc: ParallelConfig, comm_manager: CommManager | None, num_tokens: int, device: torch.device | str = "cpu"
) -> TokenLayout:
    """This step's layout. Sharded layouts agree on ``rows`` through one all_reduce(MAX) over the world,
    so every rank of the world must call this once per step (a rank without work passes its dummy step)."""
    if not needs_sharded_layout(pc):
        return TokenLayout(num_tokens=num_tokens)
    size, rank, group = tp_info(comm_manager, ATTN_GROUP)
    most = torch.tensor([num_tokens], device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return TokenLayout(True, num_tokens, -(-int(most) // size), size, rank, group)


def any_rank(flag: bool, device: torch.device | str = "cpu") -> bool:
    """True when `flag` is true on some rank of the world (lock-step loops stop together)."""
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero rows appended along dim -2 up to `rows`."""
    return F.pad(x, (0, 0, 0, rows - x.shape[-2])) if x.shape[-2] < rows else x


def gather_tokens(x: torch.Tensor) -> torch.Tensor:
    """[..., rows, H] chunks -> [..., num_tokens, H], all real tokens of this DP rank (identity if replicated)."""
    layout = current_layout()
    if not layout.sharded:
        return x
    return all_gather(x, layout.attn_group, dim=-2)[..., : layout.num_tokens, :]


def scatter_tokens(x: torch.Tensor) -> torch.Tensor:
    """Sums partial [..., num_tokens, H] over attn_tp_group and keeps this rank's [..., rows, H] chunk."""
    layout = current_layout()
    return reduce_scatter(pad_rows(x, layout.rows * layout.attn_tp_size), layout.attn_group, dim=-2)


def own_chunk(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """This rank's chunk of the DP rank's tokens along dim (negative): input ids entering a sharded layout along
    the last dim, a replicated unit's output [..., T, H] along -2."""
    layout = current_layout()
    if not layout.sharded:
        return x
    padding = [0, 0] * (-dim - 1) + [0, layout.rows * layout.attn_tp_size - x.shape[dim]]
    return F.pad(x, padding).narrow(dim, layout.attn_tp_rank * layout.rows, layout.rows)


class TPRegion:
    """Entry and exit of a tensor-parallel unit whose last layer is a RowParallelLinear(reduce_results=False).

    ``whole_sequence``: the unit mixes tokens (attention) and so runs on all real tokens of its DP rank. A group
    name of None, or one not registered, is a group of this rank alone.
    """

    def __init__(
        self, comm_manager: CommManager | None, group_name: str | None, whole_sequence: bool = False
    ):
        self.group_name = group_name
        self.tp_size, _, self.group = tp_info(comm_manager, group_name)
        self.whole_sequence = whole_sequence

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        if not current_layout().sharded:
            return x
        return gather_tokens(x) if self.whole_sequence else all_gather(x, self.group, dim=-2)

    def exit(self, x: torch.Tensor) -> torch.Tensor:
        if not current_layout().sharded:
            return all_reduce(x, self.group)
        return scatter_tokens(x) if self.whole_sequence else reduce_scatter(x, self.group, dim=-2)


class ReplicatedRegion:
    """Entry and exit of a unit every rank of attn_tp_group runs whole, its weights, heads and KV cache unsplit
    (attention `skill parallelize --replicate-attention` could not shard): it runs on all real tokens of its DP
    rank, and each rank keeps its own rows of the result on the way out; nothing is summed. ``tp_group`` names
    the group (the model registers it: the step's token layout is sized from it)."""

    def __init__(self, tp_group: str = ATTN_GROUP):
        assert tp_group == ATTN_GROUP, "a replicated unit gathers the tokens of attn_tp_group"

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return gather_tokens(x)

    def exit(self, x: torch.Tensor) -> torch.Tensor:
        return own_chunk(x, dim=-2)
