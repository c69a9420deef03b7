"""Named process groups laid out over the world; groups with identical ranks and backend share one communicator."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.distributed import ProcessGroup

if TYPE_CHECKING:
    from runtime.config import ParallelConfig

# The TP group of each module kind and the parallel_config size it is laid out by (seed 002's table).
OPROJ_GROUP = "oproj_tp_group"
TP_GROUP_SIZES = {
    "attn_tp_group": "attn_tp_size",
    "dense_tp_group": "dense_tp_size",
    "embed_tp_group": "embed_tp_size",
    "lmhead_tp_group": "lmhead_tp_size",
    OPROJ_GROUP: "o_proj_tp_size",
    "moe_tp_group": "moe_tp_size",
    "shared_tp_group": "shared_tp_size",
}


def group_layout(
    world_size: int, group_num: int, group_size: int, group_stride: int = 1
) -> list[tuple[int, ...]]:
    """Global ranks of every group: stride 1 = consecutive blocks (TP), stride s > 1 = interleaved (DP / EP)."""
    assert group_num * group_size == world_size, (
        f"{group_num} groups x {group_size} ranks = {group_num * group_size}, but world_size is {world_size}"
    )
    assert group_stride >= 1 and group_num % group_stride == 0, (
        f"group_num {group_num} must be a multiple of group_stride {group_stride}"
    )
    return [
        tuple(
            (g // group_stride) * group_size * group_stride + g % group_stride + k * group_stride
            for k in range(group_size)
        )
        for g in range(group_num)
    ]


def _group_name(name: str, ranks: tuple[int, ...]) -> str:
    if len(ranks) == 1:
        return f"{name}:{ranks[0]}"
    step = ranks[1] - ranks[0]
    return f"{name}:{ranks[0]}-{ranks[-1]}" + (f"/{step}" if step > 1 else "")


@dataclass(frozen=True)
class _Spec:
    group_num: int
    group_size: int
    group_stride: int
    backend: str | None
    allow_physical_reuse: bool


@dataclass(frozen=True)
class _Entry:
    spec: _Spec
    ranks: tuple[int, ...]  # global ranks of the group holding this rank
    group: ProcessGroup | None  # None for single-rank groups
    name: str


class CommManager:
    """``create_groups=False`` records layouts only (every group None): enough to build one rank's shards
    offline, as convert-weights does."""

    def __init__(self, world_size: int, rank: int, create_groups: bool = True):
        assert 0 <= rank < world_size, f"rank {rank} outside world_size {world_size}"
        self.world_size = world_size
        self.rank = rank
        self.create_groups = create_groups
        self._entries: dict[str, _Entry] = {}
        self._physical: dict[tuple[tuple[int, ...], str | None], ProcessGroup] = {}

    def register_group(
        self,
        name: str,
        group_num: int,
        group_size: int,
        group_stride: int = 1,
        backend: str | None = None,
        allow_physical_reuse: bool = True,
    ) -> ProcessGroup | None:
        """Must be called on every rank with the same arguments, in the same order."""
        spec = _Spec(group_num, group_size, group_stride, backend, allow_physical_reuse)
        if name in self._entries:
            if self._entries[name].spec != spec:
                raise ValueError(
                    f"process group {name!r} is already registered as {self._entries[name].spec}, not {spec}"
                )
            return self._entries[name].group
        layout = group_layout(self.world_size, group_num, group_size, group_stride)
        mine = next(ranks for ranks in layout if self.rank in ranks)
        group = None
        if group_size > 1 and self.create_groups:
            # torch requires every rank to create every group, in the same order.
            for ranks in layout:
                created = self._physical_group(ranks, backend, allow_physical_reuse, _group_name(name, ranks))
                if ranks == mine:
                    group = created
        self._entries[name] = _Entry(spec, mine, group, _group_name(name, mine))
        return group

    def _physical_group(
        self, ranks: tuple[int, ...], backend: str | None, reuse: bool, desc: str
    ) -> ProcessGroup:
        key = (ranks, backend)
        if reuse and key in self._physical:
            return self._physical[key]
        group = dist.new_group(list(ranks), backend=backend, group_desc=desc)
        self._physical.setdefault(key, group)
        return group

    def init_cpu_groups(self, attn_tp_size: int) -> None:
        """Gloo groups for broadcasting Python objects: this rank's attn-TP block and the DP leaders."""
        assert self.world_size % attn_tp_size == 0, (
            f"attn_tp_size {attn_tp_size} must divide {self.world_size}"
        )
        dp_size = self.world_size // attn_tp_size
        self.register_group("tp_cpu_group", dp_size, attn_tp_size, backend="gloo")
        # Ranks sharing an attn-TP index; TP index 0 gives the leaders 0, tp, 2tp, ...
        self.register_group(
            "dp_leader_group", attn_tp_size, dp_size, group_stride=attn_tp_size, backend="gloo"
        )

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"unknown process group {name!r}; registered: {sorted(self._entries)}") from None

    def has_group(self, name: str) -> bool:
        return name in self._entries

    def get_group(self, name: str) -> ProcessGroup | None:
        return self._entry(name).group

    def get_rank(self, name: str) -> int:
        return self._entry(name).ranks.index(self.rank)

    def get_size(self, name: str) -> int:
        return len(self._entry(name).ranks)

    def get_ranks(self, name: str) -> list[int]:
        return list(self._entry(name).ranks)

    def get_group_name(self, name: str) -> str:
        return self._entry(name).name


EP_GROUP = "moe_ep_group"


def register_tp_groups(comm_manager: CommManager | None, pc: ParallelConfig, names: Iterable[str]) -> None:
    """Registers each named TP group whose size in `pc` is > 1, as consecutive blocks of ranks (`oproj_tp_group`
    only when its size differs from attn_tp_size), and `moe_ep_group` (see register_ep_groups); a layer whose
    group is absent runs unsharded."""
    if comm_manager is None:
        return
    for name in names:
        if name == EP_GROUP:
            register_ep_groups(comm_manager, pc)
            continue
        size = getattr(pc, TP_GROUP_SIZES[name])
        if name == OPROJ_GROUP and size == pc.attn_tp_size:
            continue  # o_proj then shards with attention, in attn_tp_group
        if size > 1:
            comm_manager.register_group(name, pc.world_size // size, size)


def register_ep_groups(comm_manager: CommManager, pc: ParallelConfig) -> None:
    """`moe_ep_group` when moe_ep_size > 1: the ranks sharing a moe_tp index (interleaved by moe_tp_size), each
    holding world / ep of the experts; and `moe_ep_group_mc2` over the same ranks on a communicator of its own
    (seed 002: the MC2 dispatch group never reuses a physical group)."""
    ep, tp = pc.moe_ep_size, pc.moe_tp_size
    if ep > 1:
        comm_manager.register_group(EP_GROUP, tp, ep, group_stride=tp)
        comm_manager.register_group(f"{EP_GROUP}_mc2", tp, ep, group_stride=tp, allow_physical_reuse=False)
