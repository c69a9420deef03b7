"""Expert parallelism (runtime/layers/moe.py): a model's own experts module, its experts split over moe_ep_group
and their intermediate size over moe_tp_group, gives the whole module's output in every token layout and
dispatch mode; each rank reads only its experts and its share of them."""

import pytest
import torch
import torch.nn.functional as F
from dist_harness import distributed_tests
from torch import nn

from runtime.config import InferenceConfig, ParallelConfig
from runtime.config.comm_manager import CommManager, register_ep_groups
from runtime.layers.moe import ExpertParallel
from runtime.layers.token_layout import TokenLayout, use_layout
from runtime.layers.weights import load_named_weights

EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 16, 12


class Experts(nn.Module):
    """The two shapes transformers writes experts in, routing weights applied inside, no sentinel expert id:
    Qwen3-MoE's ([E, 2I, H] gate/up halves and [E, H, I] down, F.linear) and GPT-OSS's ([E, H, 2I] gate/up
    interleaved, [E, I, H] down, `x @ w`, biases)."""

    def __init__(self, num_experts: int, oss: bool, inter: int = INTER):
        super().__init__()
        self.num_experts, self.oss = num_experts, oss
        if oss:
            self.gate_up_proj = nn.Parameter(torch.empty(num_experts, HIDDEN, 2 * inter))
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * inter))
            self.down_proj = nn.Parameter(torch.empty(num_experts, inter, HIDDEN))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, HIDDEN))
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, HIDDEN))
            self.down_proj = nn.Parameter(torch.empty(num_experts, HIDDEN, inter))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.oss:
            gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            return (up + 1) * F.silu(gate) @ self.down_proj[e] + self.down_proj_bias[e]
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[e])

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0]:
            slot, token = torch.where(mask[e])
            out.index_add_(0, token, self.expert(e, hidden[token]) * top_k_weights[token, slot, None])
        return out


class ParallelExperts(Experts):
    """What `skill parallelize` makes of it: this rank's experts (and intermediate share) behind
    ExpertParallel."""

    def __init__(self, oss: bool, infer_config, comm_manager, tp_group: str | None = None):
        self.expert_parallel = ExpertParallel(EXPERTS, infer_config, comm_manager, tp_group=tp_group)
        ep = self.expert_parallel
        super().__init__(ep.local_experts, oss, ep.tp_part(INTER))
        if oss:
            ep.shard(self.gate_up_proj, tp_dim=2)  # interleaved pairs: a contiguous share keeps them whole
            ep.shard(self.gate_up_proj_bias, tp_dim=1)
            ep.shard(self.down_proj, tp_dim=1)
            ep.shard(self.down_proj_bias, once=True)
        else:
            ep.shard(self.gate_up_proj, tp_dim=1, halves=True)
            ep.shard(self.down_proj, tp_dim=2)

    def forward(self, hidden, top_k_index, top_k_weights):
        return self.expert_parallel(super().forward, hidden, top_k_index, top_k_weights)


def _weights(oss: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    whole = Experts(EXPERTS, oss)
    return {name: torch.randn(p.shape, generator=g) * 0.3 for name, p in whole.named_parameters()}


def _tokens(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, HIDDEN, generator=g)
    scores = torch.randn(n, EXPERTS, generator=g).softmax(-1)
    weights, index = scores.topk(TOP_K, dim=-1)
    return hidden, index, weights


def _whole(oss: bool) -> Experts:
    whole = Experts(EXPERTS, oss)
    for name, w in _weights(oss).items():
        getattr(whole, name).data.copy_(w)
    return whole


def _parallel(cm: CommManager, oss: bool, moe_tp: int, dispatch: str = "all_to_all") -> ParallelExperts:
    w = cm.world_size
    pc = ParallelConfig(world_size=w, attn_tp_size=w, moe_tp_size=moe_tp, moe_dispatch=dispatch)
    if moe_tp > 1:
        cm.register_group("moe_tp_group", w // moe_tp, moe_tp)
    register_ep_groups(cm, pc)
    tp = "moe_tp_group" if moe_tp > 1 else None
    experts = ParallelExperts(oss, InferenceConfig(parallel_config=pc), cm, tp)
    for name, weight in _weights(oss).items():
        param = getattr(experts, name)
        param.weight_loader(param, weight)
    return experts


def _world(rank: int, world_size: int) -> tuple[int, int]:
    return rank, world_size  # each check lays out its own groups on a CommManager of its own


def _check(world: tuple[int, int], moe_tp: int, sharded: bool, dispatch: str = "all_to_all") -> None:
    for oss in (False, True):
        cm = CommManager(world[1], world[0])
        rows = 5
        # sharded: every rank its own rows, as between units of the TP+DP layout; else the same on every rank
        hidden, index, weights = _tokens(10 + cm.rank if sharded else 0, rows)
        if sharded and cm.rank == 0:  # a rank whose tokens all stay home, and whose experts nobody else picks
            index = torch.stack([torch.zeros(rows, dtype=torch.long), torch.ones(rows, dtype=torch.long)], -1)
        with use_layout(TokenLayout(sharded=sharded, num_tokens=rows, rows=rows)):
            out = _parallel(cm, oss, moe_tp, dispatch)(hidden, index, weights)
        torch.testing.assert_close(out, _whole(oss)(hidden, index, weights), atol=1e-5, rtol=0)


def check_ep_replicated_tokens(world: tuple[int, int]) -> None:
    _check(world, moe_tp=1, sharded=False)


def check_ep_all_to_all(world: tuple[int, int]) -> None:
    _check(world, moe_tp=1, sharded=True)


def check_ep_all_gather(world: tuple[int, int]) -> None:
    _check(world, moe_tp=1, sharded=True, dispatch="all_gather")


def check_expert_tp_replicated_tokens(world: tuple[int, int]) -> None:
    _check(world, moe_tp=2, sharded=False)  # world 4: EP 2 x TP 2


def check_expert_tp_own_rows(world: tuple[int, int]) -> None:
    _check(world, moe_tp=2, sharded=True)


def check_rank_holds_only_its_experts(world: tuple[int, int]) -> None:
    cm = CommManager(world[1], world[0])
    experts = _parallel(cm, oss=False, moe_tp=1)
    per_rank = EXPERTS // cm.world_size
    own = slice(cm.rank * per_rank, (cm.rank + 1) * per_rank)
    assert experts.gate_up_proj.shape == (per_rank, 2 * INTER, HIDDEN)
    torch.testing.assert_close(experts.down_proj.data, _weights(False)["down_proj"][own], atol=0, rtol=0)


CHECKS = {
    f.__name__: f
    for f in (
        check_ep_replicated_tokens,
        check_ep_all_to_all,
        check_ep_all_gather,
        check_expert_tp_replicated_tokens,
        check_expert_tp_own_rows,
        check_rank_holds_only_its_experts,
    )
}
world_results, test_distributed = distributed_tests(_world, CHECKS)


class _Reader:
    """A lazy checkpoint tensor that records the experts read from it."""

    def __init__(self, name: str, t: torch.Tensor, read: list[str]):
        self.name, self.t, self.read = name, t, read

    def get_shape(self) -> list[int]:
        return list(self.t.shape)

    def __getitem__(self, index):
        self.read.append(self.name)
        return self.t[index]


@pytest.mark.parametrize("moe_tp", [1, 2])
def test_per_expert_checkpoint_tensors_load_this_ranks_share_only(moe_tp):
    """Per-expert tensors on disk (experts.{i}.gate_proj / up_proj / down_proj) reach this rank's stack through
    transformers' conversion mapping, cut to its intermediate share; another rank's experts are never read."""
    world = 2 * moe_tp
    cm = CommManager(world, world - 1, create_groups=False)  # the last rank: ep rank 1, tp rank moe_tp - 1
    pc = ParallelConfig(world_size=world, attn_tp_size=world, moe_tp_size=moe_tp)
    if moe_tp > 1:
        cm.register_group("moe_tp_group", world // moe_tp, moe_tp)
    register_ep_groups(cm, pc)
    model = nn.Module()
    model.config = type("Config", (), {"model_type": "qwen3_moe"})()
    model.mlp = nn.Module()
    model.mlp.experts = ParallelExperts(False, None, cm, "moe_tp_group" if moe_tp > 1 else None)
    w, read, checkpoint = _weights(False), [], []
    for e in range(EXPERTS):
        gate, up = w["gate_up_proj"][e].chunk(2)
        for part, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", w["down_proj"][e])):
            name = f"mlp.experts.{e}.{part}.weight"
            checkpoint.append((name, _Reader(name, t, read)))
    assert load_named_weights(model, checkpoint) == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    assert {int(n.split(".")[2]) for n in read} == {4, 5, 6, 7}
    share = slice(INTER - INTER // moe_tp, INTER)
    gate, up = w["gate_up_proj"][4:].chunk(2, dim=1)
    expected = torch.cat([gate[:, share], up[:, share]], dim=1)
    torch.testing.assert_close(model.mlp.experts.gate_up_proj.data, expected, atol=0, rtol=0)
    torch.testing.assert_close(model.mlp.experts.down_proj.data, w["down_proj"][4:, :, share], atol=0, rtol=0)


def test_packed_tensor_of_the_wrong_expert_count_is_named():
    cm = CommManager(2, 0, create_groups=False)
    register_ep_groups(cm, ParallelConfig(world_size=2, attn_tp_size=2))
    experts = ParallelExperts(False, None, cm)
    with pytest.raises(ValueError, match=r"expected \[8, 16, 12\]"):
        experts.down_proj.weight_loader(experts.down_proj, torch.zeros(6, HIDDEN, INTER))
