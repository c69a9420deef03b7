"""experts: an experts module (parameters stacked per expert, forward over routed tokens) holds this rank's block of
experts of moe_ep_group and runs its own math on the pairs routed to them through ExpertParallel."""

from textwrap import dedent

import pytest
from codemod_harness import assert_codemod, assert_noop

from skills.parallel_impl.rules.experts import ShardExperts as rule

INIT = 'def __init__(self, config, infer_config, comm_manager=None, prefix=""):'

# transformers' Qwen3-MoE / Mixtral shape: the count in an attribute the shapes read
BEFORE = dedent(f"""\
    class MoeExperts(nn.Module):
        {INIT}
            super().__init__()
            self.num_experts = config.num_experts
            self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * config.moe_dim, config.hidden))
            self.down_proj = nn.Parameter(torch.empty(self.num_experts, config.hidden, config.moe_dim))
            self.act_fn = ACT2FN[config.hidden_act]

        def forward(self, hidden_states: torch.Tensor, top_k_index, top_k_weights) -> torch.Tensor:
            return expert_math(self, hidden_states, top_k_index, top_k_weights)
    """)

AFTER = dedent(f"""\
    from runtime.layers.moe import ExpertParallel

    class MoeExperts(nn.Module):
        {INIT}
            super().__init__()
            self.expert_parallel = ExpertParallel(config.num_experts, infer_config, comm_manager, ep_group="moe_ep_group", prefix=prefix)
            self.num_experts = self.expert_parallel.local_experts
            self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * config.moe_dim, config.hidden))
            self.down_proj = nn.Parameter(torch.empty(self.num_experts, config.hidden, config.moe_dim))
            self.expert_parallel.shard(self.gate_up_proj, self.down_proj)
            self.act_fn = ACT2FN[config.hidden_act]

        def forward(self, hidden_states: torch.Tensor, top_k_index, top_k_weights) -> torch.Tensor:
            return self.expert_parallel(self.run_experts, hidden_states, top_k_index, top_k_weights)

        def run_experts(self, hidden_states: torch.Tensor, top_k_index, top_k_weights) -> torch.Tensor:
            return expert_math(self, hidden_states, top_k_index, top_k_weights)
    """)

# the count written in each shape (a tuple too), with per-expert biases [E, X] as GPT-OSS holds them
BEFORE_INLINE = dedent(f"""\
    class OssExperts(nn.Module):
        {INIT}
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.empty(config.num_local_experts, config.hidden, 2 * config.dim))
            self.gate_up_proj_bias = nn.Parameter(torch.empty(config.num_local_experts, 2 * config.dim))
            self.down_proj = nn.Parameter(torch.empty((config.num_local_experts, config.dim, config.hidden)))

        def forward(self, hidden_states, router_indices, routing_weights):
            return expert_math(self, hidden_states, router_indices, routing_weights)
    """)

AFTER_INLINE = dedent(f"""\
    from runtime.layers.moe import ExpertParallel

    class OssExperts(nn.Module):
        {INIT}
            super().__init__()
            self.expert_parallel = ExpertParallel(config.num_local_experts, infer_config, comm_manager, ep_group="moe_ep_group", prefix=prefix)
            self.gate_up_proj = nn.Parameter(torch.empty(self.expert_parallel.local_experts, config.hidden, 2 * config.dim))
            self.gate_up_proj_bias = nn.Parameter(torch.empty(self.expert_parallel.local_experts, 2 * config.dim))
            self.down_proj = nn.Parameter(torch.empty((self.expert_parallel.local_experts, config.dim, config.hidden)))
            self.expert_parallel.shard(self.gate_up_proj, self.gate_up_proj_bias, self.down_proj)

        def forward(self, hidden_states, router_indices, routing_weights):
            return self.expert_parallel(self.run_experts, hidden_states, router_indices, routing_weights)

        def run_experts(self, hidden_states, router_indices, routing_weights):
            return expert_math(self, hidden_states, router_indices, routing_weights)
    """)


# expert TP where the shapes say how: gate / up halves (`.chunk`) and interleaved pairs (`::2`) with biases
BEFORE_TP = dedent(f"""\
    class MoeExperts(nn.Module):
        {INIT}
            super().__init__()
            self.num_experts = config.num_experts
            inter = config.moe_dim
            self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * inter, config.hidden))
            self.down_proj = nn.Parameter(torch.empty(self.num_experts, config.hidden, inter))

        def forward(self, hidden_states, top_k_index, top_k_weights):
            gate, up = F.linear(hidden_states, self.gate_up_proj[0]).chunk(2, dim=-1)
            return F.linear(gate * up, self.down_proj[0])
""")

AFTER_TP = dedent(f"""\
    from runtime.layers.moe import ExpertParallel

    class MoeExperts(nn.Module):
        {INIT}
            super().__init__()
            self.expert_parallel = ExpertParallel(config.num_experts, infer_config, comm_manager, ep_group="moe_ep_group", tp_group="moe_tp_group", prefix=prefix)
            self.num_experts = self.expert_parallel.local_experts
            inter = config.moe_dim
            self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.expert_parallel.tp_part(inter), config.hidden))
            self.down_proj = nn.Parameter(torch.empty(self.num_experts, config.hidden, self.expert_parallel.tp_part(inter)))
            self.expert_parallel.shard(self.gate_up_proj, tp_dim=1, halves=True)
            self.expert_parallel.shard(self.down_proj, tp_dim=2)

        def forward(self, hidden_states, top_k_index, top_k_weights):
            return self.expert_parallel(self.run_experts, hidden_states, top_k_index, top_k_weights)

        def run_experts(self, hidden_states, top_k_index, top_k_weights):
            gate, up = F.linear(hidden_states, self.gate_up_proj[0]).chunk(2, dim=-1)
            return F.linear(gate * up, self.down_proj[0])
""")

BEFORE_TP_OSS = dedent(f"""\
    class OssExperts(nn.Module):
        {INIT}
            super().__init__()
            self.dim = config.dim
            self.gate_up_proj = nn.Parameter(torch.empty(config.num_local_experts, config.hidden, 2 * self.dim))
            self.gate_up_proj_bias = nn.Parameter(torch.empty(config.num_local_experts, 2 * self.dim))
            self.down_proj = nn.Parameter(torch.empty((config.num_local_experts, self.dim, config.hidden)))
            self.down_proj_bias = nn.Parameter(torch.empty(config.num_local_experts, config.hidden))

        def forward(self, hidden_states, router_indices, routing_weights):
            gate_up = hidden_states @ self.gate_up_proj[0] + self.gate_up_proj_bias[0]
            return gate_up[..., ::2] * gate_up[..., 1::2] @ self.down_proj[0] + self.down_proj_bias[0]
""")

AFTER_TP_OSS = dedent(f"""\
    from runtime.layers.moe import ExpertParallel

    class OssExperts(nn.Module):
        {INIT}
            super().__init__()
            self.dim = config.dim
            self.expert_parallel = ExpertParallel(config.num_local_experts, infer_config, comm_manager, ep_group="moe_ep_group", tp_group="moe_tp_group", prefix=prefix)
            self.gate_up_proj = nn.Parameter(torch.empty(self.expert_parallel.local_experts, config.hidden, 2 * self.expert_parallel.tp_part(self.dim)))
            self.gate_up_proj_bias = nn.Parameter(torch.empty(self.expert_parallel.local_experts, 2 * self.expert_parallel.tp_part(self.dim)))
            self.down_proj = nn.Parameter(torch.empty((self.expert_parallel.local_experts, self.expert_parallel.tp_part(self.dim), config.hidden)))
            self.down_proj_bias = nn.Parameter(torch.empty(self.expert_parallel.local_experts, config.hidden))
            self.expert_parallel.shard(self.gate_up_proj, tp_dim=2)
            self.expert_parallel.shard(self.gate_up_proj_bias, self.down_proj, tp_dim=1)
            self.expert_parallel.shard(self.down_proj_bias, once=True)

        def forward(self, hidden_states, router_indices, routing_weights):
            return self.expert_parallel(self.run_experts, hidden_states, router_indices, routing_weights)

        def run_experts(self, hidden_states, router_indices, routing_weights):
            gate_up = hidden_states @ self.gate_up_proj[0] + self.gate_up_proj_bias[0]
            return gate_up[..., ::2] * gate_up[..., 1::2] @ self.down_proj[0] + self.down_proj_bias[0]
""")


@pytest.mark.parametrize(
    ("before", "after"),
    [(BEFORE, AFTER), (BEFORE_INLINE, AFTER_INLINE), (BEFORE_TP, AFTER_TP), (BEFORE_TP_OSS, AFTER_TP_OSS)],
    ids=["count-attribute", "count-inline", "tp-halves", "tp-interleaved-biases"],
)
def test_experts_hold_this_ranks_block(make_ctx, before, after):
    assert_codemod(rule, before, after, make_ctx)


def test_rewrite_is_reported(run_rule, make_ctx):
    ctx = make_ctx()
    run_rule(rule, BEFORE, ctx)
    assert ctx.rewrites == [
        "MoeExperts: gate_up_proj/down_proj -> this rank's experts of moe_ep_group (ExpertParallel)"
    ]


@pytest.mark.parametrize(
    "code",
    [
        # a router: 2-D parameters only
        f"""\
        class Router(nn.Module):
            {INIT}
                super().__init__()
                self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden))

            def forward(self, hidden_states, top_k_index, top_k_weights):
                return hidden_states
        """,
        # a block routing its own tokens: forward takes the hidden states only
        f"""\
        class MoeBlock(nn.Module):
            {INIT}
                super().__init__()
                self.w = nn.Parameter(torch.empty(config.num_experts, config.hidden, config.dim))

            def forward(self, hidden_states):
                return hidden_states
        """,
        # stacked parameters that disagree on the leading size
        f"""\
        class Mixed(nn.Module):
            {INIT}
                super().__init__()
                self.a = nn.Parameter(torch.empty(config.num_experts, config.hidden, config.dim))
                self.b = nn.Parameter(torch.empty(config.layers, config.hidden, config.dim))

            def forward(self, hidden_states, top_k_index, top_k_weights):
                return hidden_states
        """,
        # not plumbed: no comm_manager to find moe_ep_group with
        """\
        class Unplumbed(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.w = nn.Parameter(torch.empty(config.num_experts, config.hidden, config.dim))

            def forward(self, hidden_states, top_k_index, top_k_weights):
                return hidden_states
        """,
    ],
    ids=["router", "self-routing-block", "mixed-leads", "unplumbed"],
)
def test_leaves_other_modules_alone(make_ctx, code):
    assert_noop(rule, code, make_ctx)


def test_forward_reading_the_intermediate_size_keeps_experts_whole_per_rank(run_rule):
    """A forward that reads the whole intermediate size (`self.dim`) gets expert parallelism but no expert TP."""
    code = BEFORE_TP_OSS.replace("gate_up[..., ::2] * gate_up[..., 1::2]", "gate_up[..., : self.dim]")
    out = run_rule(rule, code)
    assert "tp_part" not in out and "moe_tp_group" not in out and "ExpertParallel(" in out
