import pytest
import torch
import torch.distributed as dist
from dist_harness import distributed_tests

from runtime.config import ParallelConfig
from runtime.config.comm_manager import CommManager, group_layout, register_tp_groups
from runtime.distributed import backend_for, init_distributed
from runtime.errors import UserError
from runtime.layers.comm import all_gather, all_reduce, reduce_scatter


def test_layout_stride_one_is_consecutive_blocks():
    assert group_layout(4, 2, 2) == [(0, 1), (2, 3)]
    assert group_layout(8, 2, 4) == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_layout_stride_interleaves():
    assert group_layout(4, 2, 2, group_stride=2) == [(0, 2), (1, 3)]
    # 4 groups of 2 with stride 2: interleaved inside each half of the world.
    assert group_layout(8, 4, 2, group_stride=2) == [(0, 2), (1, 3), (4, 6), (5, 7)]


def test_layout_must_cover_the_world():
    with pytest.raises(AssertionError, match="world_size is 4"):
        group_layout(4, 3, 2)


def test_single_process_groups_cost_nothing():
    cm = CommManager(1, 0)
    assert cm.register_group("attn_tp_group", 1, 1) is None
    assert (cm.get_rank("attn_tp_group"), cm.get_size("attn_tp_group")) == (0, 1)
    assert cm.get_ranks("attn_tp_group") == [0]
    assert cm.get_group_name("attn_tp_group") == "attn_tp_group:0"
    cm.init_cpu_groups(1)
    assert cm.get_group("tp_cpu_group") is None and cm.get_group("dp_leader_group") is None


def test_unknown_group_lists_registered_names():
    cm = CommManager(1, 0)
    cm.register_group("moe_ep_group", 1, 1)
    assert cm.has_group("moe_ep_group") and not cm.has_group("nope")
    with pytest.raises(KeyError, match=r"'nope'.*moe_ep_group"):
        cm.get_rank("nope")


def test_oproj_group_registered_only_apart_from_attention():
    """o_proj_tp_size equal to attn_tp_size shards o_proj with attention: no oproj_tp_group of its own."""
    names = ("attn_tp_group", "oproj_tp_group")
    for attn, oproj, registered in ((2, 2, {"attn_tp_group"}), (1, 2, {"oproj_tp_group"})):
        cm = CommManager(4, 0, create_groups=False)
        pc = ParallelConfig(world_size=4, attn_tp_size=attn, o_proj_tp_size=oproj)
        register_tp_groups(cm, pc, names)
        assert {n for n in names if cm.has_group(n)} == registered


def test_reregistering_needs_identical_arguments():
    cm = CommManager(1, 0)
    cm.register_group("g", 1, 1)
    cm.register_group("g", 1, 1)
    with pytest.raises(ValueError, match="already registered"):
        cm.register_group("g", 1, 1, backend="gloo")


def test_init_distributed_single_process_makes_no_group(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    info = init_distributed("cpu")
    assert (info.rank, info.world_size, info.local_rank, info.device.type, info.backend) == (
        0,
        1,
        0,
        "cpu",
        "gloo",
    )
    assert not dist.is_initialized()


def test_backend_for_device_types():
    assert [backend_for(d) for d in ("cpu", "cuda:1", "npu")] == ["gloo", "nccl", "hccl"]
    with pytest.raises(UserError, match="meta"):
        backend_for("meta")


# ---- multi-process (gloo) ----


def _setup(rank: int, world_size: int) -> CommManager:
    return CommManager(world_size, rank)


def _reduced_ranks(cm: CommManager, name: str) -> float:
    return all_reduce(torch.tensor([float(cm.rank)]), cm.get_group(name)).item()


def check_stride_one(cm: CommManager) -> None:
    cm.register_group("tp", cm.world_size // 2, 2)
    first = cm.rank // 2 * 2
    assert cm.get_ranks("tp") == [first, first + 1]
    assert cm.get_rank("tp") == cm.rank % 2
    assert cm.get_group_name("tp") == f"tp:{first}-{first + 1}"
    assert _reduced_ranks(cm, "tp") == 2 * first + 1


def check_stride_two(cm: CommManager) -> None:
    cm.register_group("ep", 2, cm.world_size // 2, group_stride=2)
    expected = {2: [[0], [1]], 4: [[0, 2], [1, 3], [0, 2], [1, 3]]}[cm.world_size][cm.rank]
    assert cm.get_ranks("ep") == expected
    assert cm.get_rank("ep") == expected.index(cm.rank)
    assert _reduced_ranks(cm, "ep") == sum(expected)
    if cm.world_size == 4:
        assert cm.get_group_name("ep") == f"ep:{expected[0]}-{expected[1]}/2"


def check_physical_reuse(cm: CommManager) -> None:
    a = cm.register_group("attn", 1, cm.world_size)
    assert cm.register_group("embed", 1, cm.world_size) is a
    fresh = cm.register_group("lmhead", 1, cm.world_size, allow_physical_reuse=False)
    assert fresh is not a and fresh is not None
    assert _reduced_ranks(cm, "lmhead") == sum(range(cm.world_size))
    assert cm.register_group("attn", 1, cm.world_size) is a  # identical re-registration is a no-op


def check_single_rank_groups(cm: CommManager) -> None:
    assert cm.register_group("solo", cm.world_size, 1) is None
    assert (cm.get_rank("solo"), cm.get_size("solo"), cm.get_ranks("solo")) == (0, 1, [cm.rank])
    t = torch.ones(2)
    assert all_reduce(t, None) is t


def check_cpu_groups(cm: CommManager) -> None:
    cm.init_cpu_groups(2)
    leader = cm.rank // 2 * 2
    assert cm.get_ranks("tp_cpu_group") == [leader, leader + 1]
    obj = [f"hello from {cm.rank}"]
    dist.broadcast_object_list(obj, src=leader, group=cm.get_group("tp_cpu_group"))
    assert obj == [f"hello from {leader}"]
    if cm.rank % 2 == 0:
        assert cm.get_ranks("dp_leader_group") == list(range(0, cm.world_size, 2))


def check_collectives(cm: CommManager) -> None:
    group = cm.register_group("world", 1, cm.world_size)
    w, r = cm.world_size, cm.rank
    gathered = all_gather(torch.full((2, 1), float(r)), group, dim=1)
    assert torch.equal(gathered, torch.arange(w, dtype=torch.float32).expand(2, w))
    full = torch.arange(2.0 * w).repeat(3, 1)  # same on every rank: the sum is w * full
    assert torch.equal(reduce_scatter(full, group, dim=1), w * full[:, 2 * r : 2 * r + 2])


CHECKS = {
    f.__name__: f
    for f in (
        check_stride_one,
        check_stride_two,
        check_physical_reuse,
        check_single_rank_groups,
        check_cpu_groups,
        check_collectives,
    )
}


world_results, test_distributed = distributed_tests(_setup, CHECKS)
