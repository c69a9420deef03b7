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


@pytest.mark.parametrize(("before", "after"), [(BEFORE, AFTER), (BEFORE_INLINE, AFTER_INLINE)])
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
