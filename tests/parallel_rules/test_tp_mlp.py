"""mlp: gate_proj/up_proj -> MergedColumnParallelLinear, a lone up projection -> ColumnParallelLinear, the
down projection -> RowParallelLinear, a TPRegion around forward; anything else stays replicated."""

from textwrap import dedent

import pytest

from skills.parallel_impl.rules.mlp import ShardMLP as rule

BEFORE = dedent("""\
    class LlamaMLP(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
            self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
            self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
            self.act_fn = ACT2FN[config.hidden_act]

        def forward(self, x):
            down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
            return down_proj
    """)

AFTER = dedent("""\
    from runtime.layers.linear import MergedColumnParallelLinear, RowParallelLinear
    from runtime.layers.prefix import join_prefix
    from runtime.layers.token_layout import TPRegion

    class LlamaMLP(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size, config.intermediate_size], bias=config.mlp_bias, comm_manager=comm_manager, tp_group="dense_tp_group", prefix=join_prefix(prefix, "gate_up_proj"))
            self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias, reduce_results=False, comm_manager=comm_manager, tp_group="dense_tp_group", prefix=join_prefix(prefix, "down_proj"))
            self.act_fn = ACT2FN[config.hidden_act]
            self.tp_region = TPRegion(comm_manager, "dense_tp_group")

        def forward(self, x):
            x = self.tp_region.enter(x)
            gate_proj_out, up_proj_out = self.gate_up_proj(x).split(self.gate_up_proj.output_partition_sizes, dim=-1)
            down_proj = self.down_proj(self.act_fn(gate_proj_out) * up_proj_out)
            return self.tp_region.exit(down_proj)
    """)

# Phi-style: fc1 / fc2, no gate, nn.Linear's default bias=True made explicit.
PLAIN = dedent("""\
    class PhiMLP(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
            self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

        def forward(self, hidden_states):
            return self.fc2(self.activation_fn(self.fc1(hidden_states)))
    """)

PLAIN_AFTER = dedent("""\
    from runtime.layers.linear import ColumnParallelLinear, RowParallelLinear
    from runtime.layers.prefix import join_prefix
    from runtime.layers.token_layout import TPRegion

    class PhiMLP(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.fc1 = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True, comm_manager=comm_manager, tp_group="dense_tp_group", prefix=join_prefix(prefix, "fc1"))
            self.fc2 = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=True, reduce_results=False, comm_manager=comm_manager, tp_group="dense_tp_group", prefix=join_prefix(prefix, "fc2"))
            self.tp_region = TPRegion(comm_manager, "dense_tp_group")

        def forward(self, hidden_states):
            hidden_states = self.tp_region.enter(hidden_states)
            return self.tp_region.exit(self.fc2(self.activation_fn(self.fc1(hidden_states))))
    """)


def test_gated_mlp_sharded(run_rule, make_ctx):
    ctx = make_ctx()
    assert run_rule(rule, BEFORE, ctx) == AFTER
    assert ctx.rewrites == [
        "LlamaMLP: gate_proj/up_proj -> MergedColumnParallelLinear gate_up_proj (dense_tp_group)",
        "LlamaMLP: down_proj -> RowParallelLinear (dense_tp_group)",
    ]
    assert ctx.fused == [(".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]


def test_plain_mlp_sharded(run_rule, make_ctx):
    ctx = make_ctx()
    assert run_rule(rule, PLAIN, ctx) == PLAIN_AFTER
    assert ctx.rewrites == [
        "PhiMLP: fc1 -> ColumnParallelLinear (dense_tp_group)",
        "PhiMLP: fc2 -> RowParallelLinear (dense_tp_group)",
    ]
    assert ctx.fused == []


def test_idempotent(run_rule, make_ctx):
    ctx = make_ctx()
    assert run_rule(rule, AFTER, ctx) == AFTER
    assert run_rule(rule, PLAIN_AFTER, ctx) == PLAIN_AFTER
    assert ctx.rewrites == ctx.fused == []


def test_non_mlp_untouched(run_rule, make_ctx):
    # A MoE block: router `gate` next to 3-D experts; the MLP matching stops at the router.
    code = dedent("""\
        class MixtralSparseMoeBlock(nn.Module):
            def __init__(self, config, infer_config, comm_manager=None, prefix=""):
                super().__init__()
                self.gate = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
                self.experts = MixtralExperts(config)

            def forward(self, hidden_states):
                return self.experts(hidden_states, self.gate(hidden_states))
        """)
    assert run_rule(rule, code) == code


def test_unshardable_mlp_stays_replicated(run_rule, make_ctx):
    cases = [
        BEFORE.replace(', comm_manager=None, prefix=""', ""),  # no migrated plumbing
        BEFORE.replace("return down_proj", "return down_proj + x"),  # partial sums mixed with replicated x
        BEFORE.replace("* self.up_proj(x)", "* self.up_proj(x) * self.gate_proj(x)"),  # gate called twice
        BEFORE.replace("self.up_proj(x)", "self.up_proj(x * 2)"),  # gate and up on different inputs
        BEFORE.replace("bias=config.mlp_bias)\n        self.up", "dtype=torch.float32)\n        self.up"),
        BEFORE.replace("        self.act_fn", "        self.shared = nn.Linear(1, 2)\n        self.act_fn"),
        BEFORE.replace(  # BitNet: a norm over the whole intermediate width, between the projections
            "        self.act_fn",
            "        self.sub_norm = RMSNorm(config.intermediate_size)\n        self.act_fn",
        ).replace("self.act_fn(self.gate_proj(x))", "self.sub_norm(self.act_fn(self.gate_proj(x)))"),
    ]
    for code in cases:
        assert code != BEFORE
        ctx = make_ctx()
        assert run_rule(rule, code, ctx) == code
        assert ctx.rewrites == ctx.fused == ctx.findings == []


GLM = dedent("""\
    class GLMMLP(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.dense_h_to_4h = nn.Linear(config.hidden_size, 2 * config.ffn_hidden_size, bias=False)
            self.dense_4h_to_h = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=False)

        def forward(self, x):
            gate, up = self.dense_h_to_4h(x).chunk(2, dim=-1)
            return self.dense_4h_to_h(F.silu(gate) * up)
    """)


def test_gate_and_up_fused_on_disk_keep_their_halves(run_rule, make_ctx):
    # ChatGLM / Phi-3: [gate; up] in one column that forward halves; each rank keeps its share of each half.
    ctx = make_ctx()
    out = run_rule(rule, GLM, ctx)
    assert (
        "self.dense_h_to_4h = MergedColumnParallelLinear(config.hidden_size, [config.ffn_hidden_size, "
        "config.ffn_hidden_size], bias=False," in out
    )
    assert "gate, up = self.dense_h_to_4h(x).chunk(2, dim=-1)" in out  # the rank's [gate; up] halves as is
    assert (
        ctx.rewrites[0]
        == "GLMMLP: dense_h_to_4h -> MergedColumnParallelLinear dense_h_to_4h (dense_tp_group)"
    )
    assert ctx.fused == ctx.findings == []  # the checkpoint names the fused tensor itself
    assert run_rule(rule, out) == out
    phi3 = GLM.replace(  # the output bound to a name the halving rebinds
        "gate, up = self.dense_h_to_4h(x).chunk(2, dim=-1)",
        "up = self.dense_h_to_4h(x)\n        gate, up = up.chunk(2, dim=-1)",
    )
    assert "MergedColumnParallelLinear(" in run_rule(rule, phi3)
    read_again = phi3.replace("return self.dense_4h_to_h(", "return up + self.dense_4h_to_h(").replace(
        "gate, up = up", "gate, u = up"
    )
    assert "MergedColumnParallelLinear(" not in run_rule(rule, read_again)


def test_gate_and_up_halved_by_torch_chunk_into_a_new_name_keep_their_halves(run_rule, make_ctx):
    # ChatGLM's own code: `x = torch.chunk(y, 2, dim=-1)`, then y rebound to the product of the halves
    code = GLM.replace(
        "gate, up = self.dense_h_to_4h(x).chunk(2, dim=-1)\n        return self.dense_4h_to_h(F.silu(gate) * up)",
        "y = self.dense_h_to_4h(x)\n        halves = torch.chunk(y, 2, dim=-1)\n"
        "        y = F.silu(halves[0]) * halves[1]\n        return self.dense_4h_to_h(y)",
    )
    ctx = make_ctx()
    out = run_rule(rule, code, ctx)
    assert "self.dense_h_to_4h = MergedColumnParallelLinear(" in out
    assert "halves = torch.chunk(y, 2, dim=-1)" in out and ctx.findings == []
    assert run_rule(rule, out) == out
    assert "MergedColumnParallelLinear(" in run_rule(
        rule, code.replace("torch.chunk(y, 2, dim=-1)", "y.chunk(2, -1)")
    )
    for cut in (
        "torch.chunk(y, 2, dim=0)",
        "torch.chunk(y, 3, -1)",
        "torch.chunk(y, 2, 1)",
    ):  # something else
        assert run_rule(rule, code.replace("torch.chunk(y, 2, dim=-1)", cut)) == code.replace(
            "torch.chunk(y, 2, dim=-1)", cut
        )
    read_again = code.replace(
        "return self.dense_4h_to_h(y)", "return self.dense_4h_to_h(y) + y.sum()"
    ).replace("        y = F.silu", "        z = F.silu")
    assert run_rule(rule, read_again) == read_again


def test_fused_column_cut_otherwise_stays_replicated(run_rule, make_ctx):
    # a contiguous shard of a column cut any other way (thirds, interleaved halves) would mix its parts
    for cut in ("chunk(3, dim=-1)", "chunk(2, dim=0)", "split(2, dim=-1)"):
        code = GLM.replace("chunk(2, dim=-1)", cut)
        ctx = make_ctx()
        assert run_rule(rule, code, ctx) == code
        assert ctx.rewrites == ctx.fused == ctx.findings == []
    code = GLM.replace("2 * config.ffn_hidden_size", "3 * config.ffn_hidden_size")
    assert run_rule(rule, code) == code


def test_residual_added_inside_forward_is_added_to_the_sums(run_rule, make_ctx):
    # BLOOM / MPT: the MLP adds the residual it is given; the partial sums are reduced before that, once.
    code = BEFORE.replace("def forward(self, x):", "def forward(self, x, residual):").replace(
        "return down_proj", "return down_proj + residual"
    )
    ctx = make_ctx()
    out = run_rule(rule, code, ctx)
    assert ctx.findings == [] and ctx.rewrites
    assert "down_proj = self.tp_region.exit(self.down_proj(" in out
    assert "return down_proj + residual" in out
    assert run_rule(rule, out, make_ctx()) == out


def test_conv1d_mlp_loads_its_weights_transposed(run_rule, make_ctx):
    # GPT-2: transformers' Conv1D(nf, nx) is a linear nx -> nf with a bias, its weight stored [in, out]
    code = PLAIN.replace(
        "fc1 = nn.Linear(config.hidden_size, config.intermediate_size)",
        "c_fc = Conv1D(config.intermediate_size, config.hidden_size)",
    )
    code = code.replace(
        "fc2 = nn.Linear(config.intermediate_size, config.hidden_size)",
        "c_proj = Conv1D(config.hidden_size, config.intermediate_size)",
    )
    code = code.replace("self.fc2(", "self.c_proj(").replace("self.fc1(", "self.c_fc(")
    expected = PLAIN_AFTER.replace("bias=True,", "bias=True, transposed_on_disk=True,")
    expected = expected.replace("fc1", "c_fc").replace("fc2", "c_proj")
    ctx = make_ctx()
    assert run_rule(rule, code, ctx) == expected
    assert run_rule(rule, expected, make_ctx()) == expected
    assert ctx.rewrites == [
        "PhiMLP: c_fc -> ColumnParallelLinear (dense_tp_group)",
        "PhiMLP: c_proj -> RowParallelLinear (dense_tp_group)",
    ]


# BERT's MLP, as migrated: the up projection and activation in one module, the down projection in the sibling its
# parent hands their output to, which adds the residual and normalises.
BERT_MLP = dedent("""\
    class BertIntermediate(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
            if isinstance(config.hidden_act, str):
                self.intermediate_act_fn = ACT2FN[config.hidden_act]
            else:
                self.intermediate_act_fn = config.hidden_act

        def forward(self, hidden_states):
            hidden_states = self.dense(hidden_states)
            return self.intermediate_act_fn(hidden_states)


    class BertOutput(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
            self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

        def forward(self, hidden_states, input_tensor):
            hidden_states = self.dense(hidden_states)
            return self.LayerNorm(hidden_states + input_tensor)


    class BertLayer(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.intermediate = BertIntermediate(config, infer_config, comm_manager, join_prefix(prefix, "intermediate"))
            self.output = BertOutput(config, infer_config, comm_manager, join_prefix(prefix, "output"))

        def feed_forward_chunk(self, attention_output):
            intermediate_output = self.intermediate(attention_output)
            return self.output(intermediate_output, attention_output)
    """)

BERT_MLP_AFTER = dedent("""\
    from runtime.layers.linear import ColumnParallelLinear, RowParallelLinear
    from runtime.layers.prefix import join_prefix
    from runtime.layers.token_layout import TPRegion

    """) + BERT_MLP.replace(
    "        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)\n",
    '        self.dense = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True, comm_manager=comm_manager, tp_group="dense_tp_group", prefix=join_prefix(prefix, "dense"))\n',
).replace(
    "            self.intermediate_act_fn = config.hidden_act\n",
    '            self.intermediate_act_fn = config.hidden_act\n        self.tp_region = TPRegion(comm_manager, "dense_tp_group")\n',
).replace(
    "        hidden_states = self.dense(hidden_states)\n        return self.intermediate_act_fn",
    "        hidden_states = self.tp_region.enter(hidden_states)\n        hidden_states = self.dense(hidden_states)\n"
    "        return self.intermediate_act_fn",
).replace(
    "        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)\n",
    '        self.dense = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=True, reduce_results=False, comm_manager=comm_manager, tp_group="dense_tp_group", prefix=join_prefix(prefix, "dense"))\n',
).replace(
    "eps=config.layer_norm_eps)\n",
    'eps=config.layer_norm_eps)\n        self.tp_region = TPRegion(comm_manager, "dense_tp_group")\n',
).replace(
    "        hidden_states = self.dense(hidden_states)\n        return self.LayerNorm",
    "        hidden_states = self.tp_region.exit(self.dense(hidden_states))\n        return self.LayerNorm",
)


def test_mlp_split_over_two_modules_sharded(run_rule, make_ctx):
    ctx = make_ctx()
    assert run_rule(rule, BERT_MLP, ctx) == BERT_MLP_AFTER
    assert ctx.rewrites == [
        "BertIntermediate: dense -> ColumnParallelLinear (dense_tp_group)",
        "BertOutput: dense, which BertIntermediate's output is handed to, -> RowParallelLinear (dense_tp_group)",
    ]
    again = make_ctx()
    assert run_rule(rule, BERT_MLP_AFTER, again) == BERT_MLP_AFTER and again.rewrites == []


def test_mlp_split_over_two_modules_that_mixes_columns_stays_replicated(run_rule, make_ctx):
    cases = [
        # a norm over the whole intermediate width: a rank holds a share of it
        BERT_MLP.replace("ACT2FN[config.hidden_act]", "nn.LayerNorm(config.intermediate_size)"),
        # the intermediate output read again beside the down projection
        BERT_MLP.replace(
            "return self.output(intermediate_output, attention_output)",
            "return self.output(intermediate_output, attention_output) + intermediate_output.sum()",
        ),
        # the down projection applied after the norm, to something else than the intermediate output
        BERT_MLP.replace(
            "self.dense(hidden_states)\n        return self.LayerNorm",
            "self.dense(self.LayerNorm(hidden_states))\n        return self.LayerNorm",
        ),
        # widths that do not meet
        BERT_MLP.replace(
            "nn.Linear(config.intermediate_size, config.hidden_size)", "nn.Linear(4, config.hidden_size)"
        ),
        # the intermediate columns mixed before the activation
        BERT_MLP.replace(
            "return self.intermediate_act_fn(hidden_states)",
            "return self.intermediate_act_fn(hidden_states - hidden_states.mean(-1, keepdim=True))",
        ),
        # the intermediate output rebound between the two modules
        BERT_MLP.replace(
            "        return self.output(intermediate_output, attention_output)",
            "        if self.flag:\n            intermediate_output = attention_output\n"
            "        return self.output(intermediate_output, attention_output)",
        ),
        # either module also built elsewhere, where it may get whole inputs or give whole outputs
        BERT_MLP
        + "\n\nclass Other(nn.Module):\n    def __init__(self, config):\n        self.blocks = nn.ModuleList([BertIntermediate(config)])\n",
        BERT_MLP + "\n\nclass Sub(BertOutput):\n    pass\n",
    ]
    for code in cases:
        assert code != BERT_MLP
        ctx = make_ctx()
        assert run_rule(rule, code, ctx) == code
        assert ctx.rewrites == ctx.findings == []


# InternLM2's MLP: named otherwise, found by what forward does (two columns on the input, multiplied after an
# activation, the row on their product): each column split along its outputs as it is, unfused.
FLOW_GATED = dedent("""\
    class InternLM2MLP(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
            self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
            self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
    """)

FLOW_GATED_AFTER = dedent("""\
    from runtime.layers.linear import ColumnParallelLinear, RowParallelLinear
    from runtime.layers.prefix import join_prefix
    from runtime.layers.token_layout import TPRegion

    class InternLM2MLP(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.w1 = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=False, comm_manager=comm_manager, tp_group="dense_tp_group", prefix=join_prefix(prefix, "w1"))
            self.w3 = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=False, comm_manager=comm_manager, tp_group="dense_tp_group", prefix=join_prefix(prefix, "w3"))
            self.w2 = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False, reduce_results=False, comm_manager=comm_manager, tp_group="dense_tp_group", prefix=join_prefix(prefix, "w2"))
            self.tp_region = TPRegion(comm_manager, "dense_tp_group")

        def forward(self, x):
            x = self.tp_region.enter(x)
            return self.tp_region.exit(self.w2(F.silu(self.w1(x)) * self.w3(x)))
    """)

# GPT-J's: one name rebound through the column, the activation and the row.
FLOW_PLAIN = dedent("""\
    class GPTJMLP(nn.Module):
        def __init__(self, intermediate_size, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.fc_in = nn.Linear(config.n_embd, intermediate_size)
            self.fc_out = nn.Linear(intermediate_size, config.n_embd)
            self.act = ACT2FN[config.activation_function]

        def forward(self, hidden_states):
            hidden_states = self.fc_in(hidden_states)
            hidden_states = self.act(hidden_states)
            hidden_states = self.fc_out(hidden_states)
            return hidden_states
    """)

FLOW_PLAIN_AFTER = dedent("""\
    from runtime.layers.linear import ColumnParallelLinear, RowParallelLinear
    from runtime.layers.prefix import join_prefix
    from runtime.layers.token_layout import TPRegion

    class GPTJMLP(nn.Module):
        def __init__(self, intermediate_size, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.fc_in = ColumnParallelLinear(config.n_embd, intermediate_size, bias=True, comm_manager=comm_manager, tp_group="dense_tp_group", prefix=join_prefix(prefix, "fc_in"))
            self.fc_out = RowParallelLinear(intermediate_size, config.n_embd, bias=True, reduce_results=False, comm_manager=comm_manager, tp_group="dense_tp_group", prefix=join_prefix(prefix, "fc_out"))
            self.act = ACT2FN[config.activation_function]
            self.tp_region = TPRegion(comm_manager, "dense_tp_group")

        def forward(self, hidden_states):
            hidden_states = self.tp_region.enter(hidden_states)
            hidden_states = self.fc_in(hidden_states)
            hidden_states = self.act(hidden_states)
            hidden_states = self.fc_out(hidden_states)
            return self.tp_region.exit(hidden_states)
    """)


@pytest.mark.parametrize(
    "before,after,columns,row",
    [(FLOW_GATED, FLOW_GATED_AFTER, "w1/w3", "w2"), (FLOW_PLAIN, FLOW_PLAIN_AFTER, "fc_in", "fc_out")],
    ids=["gated", "plain"],
)
def test_an_mlp_named_otherwise_is_found_by_its_forward_and_sharded(
    run_rule, make_ctx, before, after, columns, row
):
    ctx = make_ctx()
    assert run_rule(rule, before, ctx) == after
    name = before.split("class ")[1].split("(")[0]
    assert ctx.rewrites == [
        f"{name}: {columns} -> ColumnParallelLinear (dense_tp_group)",
        f"{name}: {row} -> RowParallelLinear (dense_tp_group)",
    ]
    assert run_rule(rule, after) == after


@pytest.mark.parametrize(
    "change",
    [
        (
            "F.silu(self.w1(x)) * self.w3(x)",
            "F.softmax(self.w1(x), dim=-1) * self.w3(x)",
        ),  # mixes the columns
        (
            "F.silu(self.w1(x)) * self.w3(x)",
            "F.silu(self.w1(x)) * self.w3(x) * self.scale",
        ),  # reads another value
        (
            "F.silu(self.w1(x)) * self.w3(x)",
            "F.silu(self.w1(x)) * self.w3(self.w1(x))",
        ),  # a column called twice
        ("return self.w2(", "return x + self.w2("),  # the row's output mixed with the input
    ],
)
def test_an_mlp_whose_forward_does_more_than_act_element_wise_stays_replicated(run_rule, change):
    code = FLOW_GATED.replace(*change)
    assert run_rule(rule, code) == code


def test_a_width_computed_in_init_is_no_module_sized_by_it(run_rule, make_ctx):
    # Meta's reference Llama rounds its FFN width in __init__ (`int(...)`): arithmetic, not a module built with it
    computed = FLOW_GATED.replace("config.intermediate_size", "hidden_dim").replace(
        "        super().__init__()\n",
        "        super().__init__()\n"
        "        hidden_dim = int(2 * config.intermediate_size / 3)\n"
        "        hidden_dim = 32 * ((hidden_dim + 31) // 32)\n",
    )
    ctx = make_ctx()
    out = run_rule(rule, computed, ctx)
    assert "self.w1 = ColumnParallelLinear(config.hidden_size, hidden_dim," in out
    assert ctx.rewrites[0] == "InternLM2MLP: w1/w3 -> ColumnParallelLinear (dense_tp_group)"
    assert run_rule(rule, out) == out
    assert "hidden_dim = int(2 * config.intermediate_size / 3)" in computed
    normed = computed.replace(  # a module built with the width still keeps the MLP whole
        "        self.w2 =", "        self.sub_norm = RMSNorm(hidden_dim)\n        self.w2 ="
    )
    assert "self.sub_norm = RMSNorm(hidden_dim)" in normed and run_rule(rule, normed) == normed
