"""Expert parallelism (runtime/layers/moe.py): a model's own experts module, its experts split over moe_ep_group,
gives the whole module's output in every token layout and dispatch mode; each rank reads only its experts."""

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
    """transformers' stacked-experts shape: [E, 2I, H] gate/up, [E, H, I] down, routing weights applied inside;
    no sentinel expert id (GPT-OSS's one_hot has num_experts classes)."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * INTER, HIDDEN))
        self.down_proj = nn.Parameter(torch.empty(num_experts, HIDDEN, INTER))

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0]:
            slot, token = torch.where(mask[e])
            gate, up = F.linear(hidden[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y)
        return out


class ParallelExperts(Experts):
    """What `skill parallelize` makes of it: this rank's block of experts behind ExpertParallel."""

    def __init__(self, num_experts: int, infer_config, comm_manager):
        self.expert_parallel = ExpertParallel(num_experts, infer_config, comm_manager)
        super().__init__(self.expert_parallel.local_experts)
        self.expert_parallel.shard(self.gate_up_proj, self.down_proj)

    def forward(self, hidden, top_k_index, top_k_weights):
        return self.expert_parallel(super().forward, hidden, top_k_index, top_k_weights)


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "gate_up_proj": torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.3,
        "down_proj": torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.3,
    }


def _tokens(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, HIDDEN, generator=g)
    scores = torch.randn(n, EXPERTS, generator=g).softmax(-1)
    weights, index = scores.topk(TOP_K, dim=-1)
    return hidden, index, weights


def _whole() -> Experts:
    whole = Experts(EXPERTS)
    for name, w in _weights().items():
        getattr(whole, name).data.copy_(w)
    return whole


def _parallel(cm: CommManager, dispatch: str = "all_to_all") -> ParallelExperts:
    pc = ParallelConfig(world_size=cm.world_size, attn_tp_size=cm.world_size, moe_dispatch=dispatch)
    experts = ParallelExperts(EXPERTS, InferenceConfig(parallel_config=pc), cm)
    for name, w in _weights().items():
        param = getattr(experts, name)
        param.weight_loader(param, w)
    return experts


def _setup(rank: int, world_size: int) -> CommManager:
    cm = CommManager(world_size, rank)
    register_ep_groups(cm, ParallelConfig(world_size=world_size))
    return cm


def check_replicated_tokens(cm: CommManager) -> None:
    tokens = _tokens(0, 9)  # the same tokens on every rank (attention DP 1)
    torch.testing.assert_close(_parallel(cm)(*tokens), _whole()(*tokens), atol=1e-5, rtol=0)


def _check_sharded(cm: CommManager, dispatch: str) -> None:
    rows = 5  # every rank its own rows, as between units of the TP+DP layout
    hidden, index, weights = _tokens(10 + cm.rank, rows)
    if cm.rank == 0:  # a rank whose tokens all stay home, and whose experts nobody else picks below
        index = torch.stack([torch.zeros(rows, dtype=torch.long), torch.ones(rows, dtype=torch.long)], -1)
    layout = TokenLayout(sharded=True, num_tokens=rows, rows=rows)
    with use_layout(layout):
        out = _parallel(cm, dispatch)(hidden, index, weights)
    torch.testing.assert_close(out, _whole()(hidden, index, weights), atol=1e-5, rtol=0)


def check_sharded_all_to_all(cm: CommManager) -> None:
    _check_sharded(cm, "all_to_all")


def check_sharded_all_gather(cm: CommManager) -> None:
    _check_sharded(cm, "all_gather")


def check_rank_holds_only_its_experts(cm: CommManager) -> None:
    experts = _parallel(cm)
    per_rank = EXPERTS // cm.world_size
    own = slice(cm.rank * per_rank, (cm.rank + 1) * per_rank)
    assert experts.gate_up_proj.shape == (per_rank, 2 * INTER, HIDDEN)
    torch.testing.assert_close(experts.down_proj.data, _weights()["down_proj"][own], atol=0, rtol=0)


CHECKS = {
    f.__name__: f
    for f in (
        check_replicated_tokens,
        check_sharded_all_to_all,
        check_sharded_all_gather,
        check_rank_holds_only_its_experts,
    )
}
world_results, test_distributed = distributed_tests(_setup, CHECKS)


class _Reader:
    """A lazy checkpoint tensor that records being read."""

    def __init__(self, name: str, t: torch.Tensor, read: list[str]):
        self.name, self.t, self.read = name, t, read

    def get_shape(self) -> list[int]:
        return list(self.t.shape)

    def __getitem__(self, index):
        self.read.append(self.name)
        return self.t[index]


def test_per_expert_checkpoint_tensors_of_other_ranks_are_never_read():
    """Per-expert tensors on disk (experts.{i}.gate_proj / up_proj / down_proj) reach this rank's stack through
    transformers' conversion mapping; another rank's experts are skipped unread."""
    cm = CommManager(2, 1, create_groups=False)
    register_ep_groups(cm, ParallelConfig(world_size=2))
    model = nn.Module()
    model.config = type("Config", (), {"model_type": "qwen3_moe"})()
    model.mlp = nn.Module()
    model.mlp.experts = ParallelExperts(EXPERTS, None, cm)
    w, read = _weights(), []
    checkpoint = []
    for e in range(EXPERTS):
        gate, up = w["gate_up_proj"][e].chunk(2)
        for part, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", w["down_proj"][e])):
            name = f"mlp.experts.{e}.{part}.weight"
            checkpoint.append((name, _Reader(name, t, read)))
    assert load_named_weights(model, checkpoint) == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    assert {int(n.split(".")[2]) for n in read} == {4, 5, 6, 7}
    torch.testing.assert_close(model.mlp.experts.gate_up_proj.data, w["gate_up_proj"][4:], atol=0, rtol=0)


def test_packed_tensor_of_the_wrong_expert_count_is_named():
    cm = CommManager(2, 0, create_groups=False)
    register_ep_groups(cm, ParallelConfig(world_size=2))
    experts = ParallelExperts(EXPERTS, None, cm)
    with pytest.raises(ValueError, match=r"expected \[8, 16, 12\]"):
        experts.down_proj.weight_loader(experts.down_proj, torch.zeros(6, HIDDEN, INTER))
