"""attention: q/k/v -> QKVParallelLinear, o_proj -> RowParallelLinear, per-rank head counts, a TPRegion
around forward; attention that can't be sharded is a finding."""

from textwrap import dedent

import pytest
from transformers import LlamaConfig

from skills.parallel_impl.rewrite import parallelize_source
from skills.parallel_impl.rules.attention import ShardAttention as rule

# The migrated llama attention, shortened.
BEFORE = dedent('''\
    class LlamaAttention(nn.Module):
        def __init__(self, config, layer_idx, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.head_dim = config.head_dim
            # projections
            self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=True)
            self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=True)
            self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=True)
            self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size)
            self.attn = Attention(
                num_heads=config.num_attention_heads,
                head_dim=self.head_dim,
                num_kv_heads=config.num_key_value_heads,
                scale=self.head_dim**-0.5,
            )

        def forward(self, hidden_states, position_embeddings, *, forward_metadata, **kwargs):
            """Attends."""
            hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)

            query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
            key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            attn_output = self.attn(query_states, key_states, value_states, forward_metadata)
            attn_output = self.o_proj(attn_output.reshape(*hidden_shape[:-2], -1))
            return attn_output
    ''')

IMPORTS = dedent("""\
    from runtime.layers.linear import QKVParallelLinear, RowParallelLinear
    from runtime.layers.prefix import join_prefix
    from runtime.layers.token_layout import TPRegion

    """)

AFTER = IMPORTS + dedent('''\
    class LlamaAttention(nn.Module):
        def __init__(self, config, layer_idx, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.head_dim = config.head_dim
            # projections
            self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads, bias=True, comm_manager=comm_manager, tp_group="attn_tp_group", prefix=join_prefix(prefix, "qkv_proj"))
            self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=True, reduce_results=False, comm_manager=comm_manager, tp_group="attn_tp_group", prefix=join_prefix(prefix, "o_proj"))
            self.attn = Attention(
                num_heads=self.qkv_proj.num_heads,
                head_dim=self.head_dim,
                num_kv_heads=self.qkv_proj.num_kv_heads,
                scale=self.head_dim**-0.5,
            )
            self.tp_region = TPRegion(comm_manager, "attn_tp_group", whole_sequence=True)

        def forward(self, hidden_states, position_embeddings, *, forward_metadata, **kwargs):
            """Attends."""
            hidden_states = self.tp_region.enter(hidden_states)
            hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)

            q_proj_out, k_proj_out, v_proj_out = self.qkv_proj(hidden_states).split(self.qkv_proj.output_partition_sizes, dim=-1)
            query_states = self.q_norm(q_proj_out.view(hidden_shape)).transpose(1, 2)
            key_states = k_proj_out.view(hidden_shape).transpose(1, 2)
            value_states = v_proj_out.view(hidden_shape).transpose(1, 2)
            attn_output = self.attn(query_states, key_states, value_states, forward_metadata)
            attn_output = self.o_proj(attn_output.reshape(*hidden_shape[:-2], -1))
            return self.tp_region.exit(attn_output)
    ''')


def test_attention_sharded_by_heads(run_rule, make_ctx):
    ctx = make_ctx()
    assert run_rule(rule, BEFORE, ctx) == AFTER
    assert ctx.rewrites == [
        "LlamaAttention: q_proj/k_proj/v_proj -> QKVParallelLinear qkv_proj (attn_tp_group)",
        "LlamaAttention: o_proj -> RowParallelLinear (attn_tp_group)",
    ]
    assert ctx.fused == [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
    ]
    assert ctx.findings == []


def test_idempotent(run_rule, make_ctx):
    ctx = make_ctx()
    assert run_rule(rule, AFTER, ctx) == AFTER
    assert ctx.rewrites == ctx.fused == ctx.findings == []


def test_no_attention_untouched(run_rule, make_ctx):
    code = dedent("""\
        class LlamaRMSNorm(nn.Module):
            def __init__(self, hidden_size, eps=1e-6):
                super().__init__()
                self.weight = nn.Parameter(torch.ones(hidden_size))

            def forward(self, hidden_states):
                return self.weight * hidden_states
        """)
    ctx = make_ctx()
    assert run_rule(rule, code, ctx) == code
    assert ctx.rewrites == ctx.findings == []


def test_absent_kv_heads_passed_explicitly(run_rule):
    code = BEFORE.replace("            num_kv_heads=config.num_key_value_heads,\n", "")
    out = run_rule(rule, code)
    assert (
        "QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads, "
        "config.num_attention_heads, bias=True," in out
    )
    assert "scale=self.head_dim**-0.5,num_kv_heads=self.qkv_proj.num_kv_heads" not in out
    assert "num_kv_heads=self.qkv_proj.num_kv_heads" in out


def test_fused_qkv_cut_other_than_in_blocks_is_a_finding(make_ctx):
    # the fused output cut by a function the rule does not read: its blocks are not known to be [q; k; v]
    code = dedent("""\
        class GPTNeoXAttention(nn.Module):
            def __init__(self, config, layer_idx, infer_config, comm_manager=None, prefix=""):
                super().__init__()
                self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)
                self.dense = nn.Linear(config.hidden_size, config.hidden_size)
                self.attn = Attention(num_heads=config.num_attention_heads, head_dim=self.head_size, scale=1.0)

            def forward(self, hidden_states, *, forward_metadata, **kwargs):
                q, k, v = torch.tensor_split(self.query_key_value(hidden_states), 3, dim=-1)
                return self.dense(self.attn(q, k, v, forward_metadata))
        """)
    ctx = make_ctx(filename="modeling_gpt_neox.py")
    assert "QKVParallelLinear" not in parallelize_source(code, ctx)
    (finding,) = ctx.findings
    assert str(finding).startswith(
        "modeling_gpt_neox.py:1 in GPTNeoXAttention: attention cannot be sharded by heads: "
        "`self.query_key_value` is q/k/v fused on disk, and forward does not bind"
    )
    assert finding.rule == rule.ID and str(finding).endswith(f" [{rule.ID}]")  # which rule refused


NEOX_BEFORE = dedent("""\
    class GPTNeoXAttention(nn.Module):
        def __init__(self, config, layer_idx, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.head_size = config.hidden_size // config.num_attention_heads
            self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
            self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=True)
            self.attn = Attention(num_heads=config.num_attention_heads, head_dim=self.head_size, scale=1.0)

        def forward(self, hidden_states, *, forward_metadata, **kwargs):
            input_shape = hidden_states.shape[:-1]
            hidden_shape = (*input_shape, -1, 3 * self.head_size)
            qkv = self.query_key_value(hidden_states).view(hidden_shape).transpose(1, 2)
            query_states, key_states, value_states = qkv.chunk(3, dim=-1)
            attn_output = self.attn(query_states, key_states, value_states, forward_metadata)
            return self.dense(attn_output.reshape(*input_shape, -1))
    """)


def test_qkv_interleaved_per_head_on_disk_is_split_by_whole_heads(run_rule, make_ctx):
    """GPT-NeoX stores q, k and v of each head together ([heads, 3, head_size] rows) and views its output per head:
    a rank's contiguous share of the rows is its heads' q, k and v, so the fused projection is column-parallel."""
    ctx = make_ctx()
    out = run_rule(rule, NEOX_BEFORE, ctx)
    assert ctx.findings == ctx.fused == []
    assert (
        ctx.rewrites[0]
        == "GPTNeoXAttention: query_key_value -> ColumnParallelLinear by heads (attn_tp_group)"
    )
    assert (
        "self.query_key_value = ColumnParallelLinear(config.hidden_size, 3 * config.hidden_size, bias=True"
        in out
    )
    assert 'num_heads=local_heads(config.num_attention_heads, comm_manager, "attn_tp_group")' in out
    assert "qkv = self.query_key_value(hidden_states).view(hidden_shape).transpose(1, 2)" in out
    assert "whole_blocks" not in out  # blocks of one head each: local_heads checks they divide evenly
    again = make_ctx()
    assert run_rule(rule, out, again) == out and again.findings == []


def test_qkv_interleaved_per_head_with_fewer_key_heads_is_a_finding(run_rule, make_ctx):
    code = NEOX_BEFORE.replace("scale=1.0)", "scale=1.0, num_kv_heads=2)")
    what = _finding(run_rule, make_ctx, code, "GPTNeoXAttention")
    assert "interleaves q, k and v per head, with fewer key heads than query heads" in what


@pytest.mark.parametrize("kv_heads, identical", [(4, True), (2, False)])
def test_key_heads_written_otherwise_are_read_off_the_checkpoint(run_rule, make_ctx, kv_heads, identical):
    # Falcon's per-head layout gives its Attention `self.num_kv_heads`, set from the config: equal to the query
    # heads in this checkpoint, so the rows split by heads, and __init__ checks it for whatever config it is given
    code = NEOX_BEFORE.replace(
        "        self.attn = Attention(",
        "        self.num_kv_heads = config.num_key_value_heads\n        self.attn = Attention(",
    ).replace("scale=1.0)", "scale=1.0, num_kv_heads=self.num_kv_heads)")
    assert "self.num_kv_heads = config" in code
    ctx = make_ctx(checkpoint_config=LlamaConfig(num_attention_heads=4, num_key_value_heads=kv_heads))
    out = run_rule(rule, code, ctx)
    if identical:
        assert "interleaved_heads(config.num_attention_heads, self.num_kv_heads)\n" in out
    else:
        assert out == code and "fewer key heads than query heads" in ctx.findings[0].what


def _finding(run_rule, make_ctx, code: str, scope: str = "LlamaAttention") -> str:
    """The single finding of an attention class the rule must leave as it is."""
    ctx = make_ctx()
    assert run_rule(rule, code, ctx) == code
    (finding,) = ctx.findings
    assert finding.scope == scope and ctx.rewrites == ctx.fused == []
    return finding.what


def test_unshardable_attention_is_a_finding(run_rule, make_ctx):
    cases = {
        "called on different inputs": BEFORE.replace(
            "self.v_proj(hidden_states)", "self.v_proj(hidden_shape)"
        ),
        "exactly once": BEFORE.replace(
            "attn_output = self.attn(", "attn_output = self.k_proj(hidden_states) + self.attn("
        ),
        "used outside __init__ and forward": BEFORE
        + "\n    def extra_repr(self):\n        return str(self.q_proj)\n",
        "lacks the migrated `comm_manager` / `prefix`": BEFORE.replace(', comm_manager=None, prefix=""', ""),
        "whole model's `num_heads`": BEFORE.replace(
            "(*hidden_states.shape[:-1], -1,", "(-1, self.num_heads,"
        ),
        "does not return o_proj's output as is": BEFORE.replace(  # partial sums mixed with replicated values
            "return attn_output", "return attn_output + hidden_states"
        ),
        "no `self.o_proj = nn.Linear(...)`": BEFORE.replace("self.o_proj = nn.Linear", "self.o_proj = Other"),
        "builds no runtime `Attention(...)` layer": BEFORE.replace(
            "self.attn = Attention(", "self.attn = Other("
        ),
        "forward runs 2 runtime Attention layers": BEFORE.replace(  # DiffLlama's two softmaxes over one q / k
            "        self.attn = Attention(",
            "        self.attn_2 = Attention(num_heads=config.num_attention_heads, head_dim=self.head_dim, "
            "num_kv_heads=config.num_key_value_heads)\n        self.attn = Attention(",
        ).replace("attn_output = self.attn(", "attn_output = self.attn_2(*attn_inputs) - self.attn("),
        "several with different head counts": BEFORE.replace(
            "        self.attn = Attention(",
            "        self.attn_2 = Attention(num_heads=2, head_dim=64)\n        self.attn = Attention(",
        ),
        "built before q_proj": BEFORE.replace(
            "        # projections\n", "        self.attn = Attention(num_heads=8, head_dim=64, scale=1.0)\n"
        ).replace("        self.attn = Attention(\n", "        self.attn2 = Other(\n"),
        "is sized for all heads": BEFORE.replace(  # OLMo2's q_norm over the whole q projection
            "        self.attn = Attention(",
            "        self.q_norm = RMSNorm(config.num_attention_heads * self.head_dim)\n        self.attn = Attention(",
        ),
        "tiled over the query heads": BEFORE.replace(  # JetMoE
            "scale=self.head_dim**-0.5,\n",
            "scale=self.head_dim**-0.5,\n                kv_heads_tiled=True,\n",
        ),
        "whole model's `n_heads`": BEFORE.replace(  # set twice: not one value to take a rank's share of
            "        # projections\n", "        self.n_heads = 4\n        self.n_heads += 4\n"
        ).replace("(*hidden_states.shape[:-1], -1,", "(-1, self.n_heads,"),
        "computed after q_proj": BEFORE.replace("head_dim=self.head_dim", "head_dim=self.head_dim2").replace(
            "        self.attn = Attention(",
            "        self.head_dim2 = self.q_proj.out_features // 8\n        self.attn = Attention(",
        ),
    }
    for reason, code in cases.items():
        assert code != BEFORE, reason
        what = _finding(run_rule, make_ctx, code)
        assert what.startswith("attention cannot be sharded by heads: ") and reason in what, (reason, what)


# JetMoE: keys tiled over the query heads, which no rank's share of the heads can take
TILED = BEFORE.replace(
    "scale=self.head_dim**-0.5,\n", "scale=self.head_dim**-0.5,\n            kv_heads_tiled=True,\n"
)

REPLICATED = dedent("""\
    from runtime.layers.token_layout import ReplicatedRegion

""") + TILED.replace(
    "            kv_heads_tiled=True,\n        )\n",
    '            kv_heads_tiled=True,\n        )\n        self.tp_region = ReplicatedRegion(tp_group="attn_tp_group")\n',
).replace(
    '        """Attends."""\n',
    '        """Attends."""\n        hidden_states = self.tp_region.enter(hidden_states)\n',
).replace("        return attn_output\n", "        return self.tp_region.exit(attn_output)\n")


def test_attention_that_cannot_be_sharded_runs_whole_on_every_rank_when_asked(run_rule, make_ctx):
    """--replicate-attention: a class the rule cannot shard keeps its layers whole, and a ReplicatedRegion
    gathers its DP rank's tokens on the way in and keeps this rank's rows on the way out (nothing summed)."""
    ctx = make_ctx(replicate_attention=True)
    assert run_rule(rule, TILED, ctx) == REPLICATED
    assert ctx.findings == [] and ctx.replicated == ["LlamaAttention"]
    assert "it cannot be sharded by heads: keys are tiled over the query heads" in ctx.rewrites[0]
    again = make_ctx(replicate_attention=True)
    assert run_rule(rule, REPLICATED, again) == REPLICATED and again.rewrites == again.replicated == []
    assert run_rule(rule, BEFORE, make_ctx(replicate_attention=True)) == AFTER  # shardable: sharded as ever
    assert "`skill parallelize --replicate-attention` runs it whole" in _finding(run_rule, make_ctx, TILED)


# DiffLlama: two softmaxes over one q / k, each on half the value heads, the outputs of head h and h + H/2 paired
PAIRED = BEFORE.replace(
    "        self.attn = Attention(",
    "        self.attn_2 = Attention(num_heads=config.num_attention_heads, head_dim=self.head_dim, "
    "num_kv_heads=config.num_key_value_heads)\n        self.attn = Attention(",
).replace(
    "        attn_output = self.attn(query_states, key_states, value_states, forward_metadata)\n",
    "        value_1, value_2 = (v.repeat(1, 2, 1, 1) for v in torch.chunk(value_states, 2, dim=1))\n"
    "        out_1 = self.attn(query_states, key_states, value_1, forward_metadata)\n"
    "        out_2 = self.attn_2(query_states, key_states, value_2, forward_metadata)\n"
    "        out_1, out_2 = torch.chunk(torch.cat([out_1, out_2], dim=-1), 2, dim=2)\n"
    "        attn_output = out_1 - out_2\n",
)


def test_heads_paired_across_runs_are_split_per_run(run_rule, make_ctx):
    """Two runtime Attention layers whose outputs forward chunks in two (DiffLlama): each rank holds its share
    of each half of the heads (QKVParallelLinear's head_groups), and both layers get its head counts."""
    ctx = make_ctx()
    out = _sharded(run_rule, make_ctx, PAIRED, ctx)
    assert "config.num_key_value_heads, bias=True, head_groups=2, comm_manager=comm_manager" in out
    assert out.count("num_heads=self.qkv_proj.num_heads") == 2
    assert out.count("num_kv_heads=self.qkv_proj.num_kv_heads") == 2
    assert "a rank's share of each of 2 runs of heads forward pairs up" in ctx.rewrites[0]


def test_heads_chunked_in_different_counts_are_a_finding(run_rule, make_ctx):
    mixed = PAIRED.replace(
        "torch.cat([out_1, out_2], dim=-1), 2, dim=2)", "torch.cat([out_1, out_2], dim=-1), 3, dim=2)"
    )
    assert mixed != PAIRED
    assert "forward runs 2 runtime Attention layers" in _finding(run_rule, make_ctx, mixed)


SINKS_LINE = "        self.sinks = nn.Parameter(torch.empty(config.num_attention_heads))\n"
SINKS_BEFORE = BEFORE.replace(
    "        self.attn = Attention(\n", SINKS_LINE + "        self.attn = Attention(\n"
).replace("value_states, forward_metadata)", "value_states, forward_metadata, sinks=self.sinks)")


def test_attention_sinks_keep_this_ranks_heads(run_rule, make_ctx):
    # GptOssAttention: one sink logit per query head, handed to the runtime Attention on every call.
    ctx = make_ctx()
    out = run_rule(rule, SINKS_BEFORE, ctx)
    assert ctx.findings == []
    assert (
        "        self.sinks = shard_heads(nn.Parameter(torch.empty(config.num_attention_heads)), comm_manager, "
        '"attn_tp_group")\n' in out
    )
    assert out.startswith("from runtime.layers.head_shard import shard_heads\n")
    assert ctx.rewrites[-1] == "LlamaAttention: sinks -> this rank's heads (shard_heads, attn_tp_group)"
    assert run_rule(rule, out) == out


def test_per_head_parameter_used_otherwise_is_a_finding(run_rule, make_ctx):
    code = SINKS_BEFORE.replace("return attn_output\n", "return attn_output * self.sinks.sum()\n")
    assert "is sized for all heads" in _finding(run_rule, make_ctx, code)


PHI3_BEFORE = dedent("""\
    class Phi3Attention(nn.Module):
        def __init__(self, config, infer_config=None, comm_manager=None, prefix=""):
            super().__init__()
            self.config = config
            self.head_dim = config.head_dim
            self.num_key_value_heads = config.num_key_value_heads
            op_size = config.num_attention_heads * self.head_dim + 2 * (config.num_key_value_heads * self.head_dim)
            self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)
            self.qkv_proj = nn.Linear(config.hidden_size, op_size, bias=False)
            self.attn = Attention(
                num_heads=config.num_attention_heads,
                head_dim=self.head_dim,
                num_kv_heads=config.num_key_value_heads,
                scale=self.head_dim**-0.5,
            )

        def forward(self, hidden_states, position_embeddings, *, forward_metadata, **kwargs):
            hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)

            qkv = self.qkv_proj(hidden_states)
            query_pos = self.config.num_attention_heads * self.head_dim
            query_states = qkv[..., :query_pos]
            key_states = qkv[..., query_pos : query_pos + self.num_key_value_heads * self.head_dim]
            value_states = qkv[..., query_pos + self.num_key_value_heads * self.head_dim :]

            query_states = query_states.view(hidden_shape).transpose(1, 2)
            attn_output = self.attn(query_states, key_states, value_states, forward_metadata)
            return self.o_proj(attn_output)
    """)

PHI3_AFTER = IMPORTS + dedent("""\
    class Phi3Attention(nn.Module):
        def __init__(self, config, infer_config=None, comm_manager=None, prefix=""):
            super().__init__()
            self.config = config
            self.head_dim = config.head_dim
            self.num_key_value_heads = config.num_key_value_heads
            self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False, reduce_results=False, comm_manager=comm_manager, tp_group="attn_tp_group", prefix=join_prefix(prefix, "o_proj"))
            self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads, bias=False, comm_manager=comm_manager, tp_group="attn_tp_group", prefix=join_prefix(prefix, "qkv_proj"))
            self.attn = Attention(
                num_heads=self.qkv_proj.num_heads,
                head_dim=self.head_dim,
                num_kv_heads=self.qkv_proj.num_kv_heads,
                scale=self.head_dim**-0.5,
            )
            self.tp_region = TPRegion(comm_manager, "attn_tp_group", whole_sequence=True)

        def forward(self, hidden_states, position_embeddings, *, forward_metadata, **kwargs):
            hidden_states = self.tp_region.enter(hidden_states)
            hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)

            qkv = self.qkv_proj(hidden_states)
            query_states, key_states, value_states = qkv.split(self.qkv_proj.output_partition_sizes, dim=-1)

            query_states = query_states.view(hidden_shape).transpose(1, 2)
            attn_output = self.attn(query_states, key_states, value_states, forward_metadata)
            return self.tp_region.exit(self.o_proj(attn_output))
    """)


def test_qkv_fused_on_disk_in_blocks_is_split_per_rank(run_rule, make_ctx):
    # Phi-3: one [q; k; v] tensor on disk, cut in forward at whole-model sizes; its loader splits it per rank.
    ctx = make_ctx()
    assert run_rule(rule, PHI3_BEFORE, ctx) == PHI3_AFTER
    assert ctx.findings == [] and ctx.fused == []  # the checkpoint names qkv_proj itself
    assert ctx.rewrites[0] == "Phi3Attention: qkv_proj -> QKVParallelLinear qkv_proj (attn_tp_group)"
    assert run_rule(rule, PHI3_AFTER) == PHI3_AFTER


def test_fused_qkv_cut_out_of_order_is_a_finding(run_rule, make_ctx):
    code = PHI3_BEFORE.replace("qkv[..., :query_pos]", "qkv[..., :self.head_dim]")
    what = _finding(run_rule, make_ctx, code, "Phi3Attention")
    assert "other than as 3 consecutive slices of its last dim" in what


OLMO2_BEFORE = (
    BEFORE.replace(
        "        self.attn = Attention(\n",
        "        self.q_norm = Olmo2RMSNorm(config.num_attention_heads * self.head_dim, config.rms_norm_eps)\n"
        "        self.k_norm = Olmo2RMSNorm(config.num_key_value_heads * self.head_dim, config.rms_norm_eps)\n"
        "        self.attn = Attention(\n",
    )
    .replace(
        "self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)",
        "self.q_norm(self.q_proj(hidden_states)).view(hidden_shape).transpose(1, 2)",
    )
    .replace(
        "self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
        "self.k_norm(self.k_proj(hidden_states)).view(hidden_shape).transpose(1, 2)",
    )
)


def test_norm_over_all_heads_runs_on_every_head(run_rule, make_ctx):
    # OLMo2: q_norm / k_norm normalise the whole q / k projection output, every head together.
    ctx = make_ctx()
    out = run_rule(rule, OLMO2_BEFORE, ctx)
    assert ctx.findings == []
    assert (
        "        self.q_norm = gather_heads(Olmo2RMSNorm(config.num_attention_heads * self.head_dim, "
        'config.rms_norm_eps), config.num_attention_heads, comm_manager, "attn_tp_group")\n' in out
    )
    assert (
        "        self.k_norm = gather_heads(Olmo2RMSNorm(config.num_key_value_heads * self.head_dim, "
        'config.rms_norm_eps), config.num_key_value_heads, comm_manager, "attn_tp_group")\n' in out
    )
    assert "query_states = self.q_norm(q_proj_out).view(hidden_shape)" in out
    assert (
        ctx.rewrites[-1]
        == "LlamaAttention: k_norm runs on every head of k_proj's output (gather_heads, attn_tp_group)"
    )
    assert run_rule(rule, out) == out


def test_all_head_module_applied_elsewhere_is_a_finding(run_rule, make_ctx):
    code = OLMO2_BEFORE.replace(
        "self.k_norm(self.k_proj(hidden_states))", "self.k_norm(self.k_proj(hidden_states) + 1)"
    )
    assert "`self.k_norm = Olmo2RMSNorm(" in _finding(run_rule, make_ctx, code)


# Multi-head latent attention (DeepSeek-V3), shortened: low-rank q and kv projections, then per-head ones.
MLA_BEFORE = dedent('''\
    class DeepseekV3Attention(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            num_heads = config.num_attention_heads
            self.q_lora_rank = config.q_lora_rank
            self.q_proj = None if self.q_lora_rank is not None else nn.Linear(config.hidden_size, num_heads * 32, bias=False)
            self.q_a_proj = nn.Linear(config.hidden_size, self.q_lora_rank, bias=False) if self.q_lora_rank is not None else None
            self.q_b_proj = nn.Linear(self.q_lora_rank, num_heads * 32, bias=False) if self.q_lora_rank is not None else None
            self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, config.kv_lora_rank + 16, bias=False)
            self.kv_b_proj = nn.Linear(config.kv_lora_rank, num_heads * 32, bias=False)
            self.o_proj = nn.Linear(num_heads * 16, config.hidden_size, bias=False)
            self.attn = Attention(num_heads=config.num_attention_heads, head_dim=32, v_head_dim=16, scale=1.0)

        def expand_kv(self, latent):
            """Keys and values [batch, num_heads, seq, dim] from the latent."""
            return self.kv_b_proj(latent).view(*latent.shape[:-1], -1, 32).split([16, 16], dim=-1)

        def forward(self, hidden_states, *, forward_metadata, **kwargs):
            q = self.q_b_proj(self.q_a_proj(hidden_states)).view(*hidden_states.shape[:-1], -1, 32)
            k, v = self.expand_kv(self.kv_a_proj_with_mqa(hidden_states)[..., :32])
            attn_output = self.attn(q, k, v, forward_metadata)
            return self.o_proj(attn_output.flatten(-2))
    ''')

MLA_AFTER = dedent('''\
    from runtime.layers.head_shard import local_heads
    from runtime.layers.linear import ColumnParallelLinear
    from runtime.layers.oproj import OProjParallelLinear
    from runtime.layers.prefix import join_prefix
    from runtime.layers.token_layout import TPRegion

    class DeepseekV3Attention(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            num_heads = config.num_attention_heads
            self.q_lora_rank = config.q_lora_rank
            self.q_proj = None if self.q_lora_rank is not None else ColumnParallelLinear(config.hidden_size, num_heads * 32, bias=False, comm_manager=comm_manager, tp_group="attn_tp_group", prefix=join_prefix(prefix, "q_proj"))
            self.q_a_proj = nn.Linear(config.hidden_size, self.q_lora_rank, bias=False) if self.q_lora_rank is not None else None
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, num_heads * 32, bias=False, comm_manager=comm_manager, tp_group="attn_tp_group", prefix=join_prefix(prefix, "q_b_proj")) if self.q_lora_rank is not None else None
            self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, config.kv_lora_rank + 16, bias=False)
            self.kv_b_proj = ColumnParallelLinear(config.kv_lora_rank, num_heads * 32, bias=False, comm_manager=comm_manager, tp_group="attn_tp_group", prefix=join_prefix(prefix, "kv_b_proj"))
            self.o_proj = OProjParallelLinear(num_heads * 16, config.hidden_size, bias=False, comm_manager=comm_manager, tp_group="oproj_tp_group", prefix=join_prefix(prefix, "o_proj"))
            self.attn = Attention(num_heads=local_heads(config.num_attention_heads, comm_manager, "attn_tp_group"), head_dim=32, v_head_dim=16, scale=1.0)
            self.tp_region = TPRegion(comm_manager, "attn_tp_group", whole_sequence=True)

        def expand_kv(self, latent):
            """Keys and values [batch, num_heads, seq, dim] from the latent."""
            return self.kv_b_proj(latent).view(*latent.shape[:-1], -1, 32).split([16, 16], dim=-1)

        def forward(self, hidden_states, *, forward_metadata, **kwargs):
            hidden_states = self.tp_region.enter(hidden_states)
            q = self.q_b_proj(self.q_a_proj(hidden_states)).view(*hidden_states.shape[:-1], -1, 32)
            k, v = self.expand_kv(self.kv_a_proj_with_mqa(hidden_states)[..., :32])
            attn_output = self.attn(q, k, v, forward_metadata)
            return self.tp_region.exit(self.o_proj(attn_output.flatten(-2)))
    ''')


def test_latent_attention_sharded_by_heads(run_rule, make_ctx):
    ctx = make_ctx()
    assert run_rule(rule, MLA_BEFORE, ctx) == MLA_AFTER
    assert ctx.rewrites == [
        "DeepseekV3Attention: q_proj/q_b_proj/kv_b_proj -> ColumnParallelLinear by heads (attn_tp_group)",
        "DeepseekV3Attention: o_proj -> OProjParallelLinear (oproj_tp_group, or attn_tp_group at o_proj_tp_size attn_tp_size)",
        "DeepseekV3Attention: q_a_proj/kv_a_proj_with_mqa stay replicated (their outputs do not count heads)",
    ]
    assert ctx.findings == ctx.fused == []
    again = make_ctx()
    assert run_rule(rule, MLA_AFTER, again) == MLA_AFTER
    assert again.rewrites == again.findings == []


def test_unshardable_latent_attention_is_a_finding(run_rule, make_ctx):
    cases = {
        "whole model's `num_heads`": MLA_BEFORE.replace(
            "(*latent.shape[:-1], -1, 32)", "(-1, self.num_heads, 32)"
        ),
        "no projection whose output size counts the heads": MLA_BEFORE.replace("num_heads * 32", "256"),
        "does not return o_proj's output as is": MLA_BEFORE.replace(
            "return self.o_proj(attn_output.flatten(-2))", "return self.o_proj(attn_output.flatten(-2)) + 1"
        ),
        "lacks the migrated `comm_manager`": MLA_BEFORE.replace(', comm_manager=None, prefix=""', ""),
    }
    for reason, code in cases.items():
        assert code != MLA_BEFORE, reason
        ctx = make_ctx()
        assert run_rule(rule, code, ctx) == code
        (finding,) = ctx.findings
        assert finding.scope == "DeepseekV3Attention" and reason in finding.what, (reason, finding.what)


def _sharded(run_rule, make_ctx, code: str, ctx=None) -> str:
    """The rewritten code of an attention class the rule shards (ctx: the context to rewrite it in, to read its
    rewrites after), checked idempotent."""
    ctx = ctx or make_ctx()
    out = run_rule(rule, code, ctx)
    assert ctx.findings == []
    again = make_ctx()
    assert run_rule(rule, out, again) == out and again.findings == again.rewrites == []
    return out


def test_alibi_slopes_keep_this_ranks_heads(run_rule, make_ctx):
    # BLOOM / MPT: one ALiBi slope per query head, given to the runtime Attention when it is built.
    code = BEFORE.replace(
        "scale=self.head_dim**-0.5,\n",
        "scale=self.head_dim**-0.5,\n                alibi_slopes=alibi_slopes(config.num_attention_heads),\n",
    )
    out = _sharded(run_rule, make_ctx, code)
    assert (
        'alibi_slopes=local_share(alibi_slopes(config.num_attention_heads), comm_manager, "attn_tp_group")'
        in out
    )
    assert "from runtime.layers.head_shard import local_share" in out


def test_an_indexers_picks_come_with_this_ranks_share_of_the_heads(run_rule, make_ctx):
    """MiniMax-M3: picks per key head (`selected=`) reach a layer holding a share of the heads, which the runtime
    cuts them to; the indexer, which projects queries and keys of its own into an IndexKeyCache, is not attention:
    it stays whole on every rank, its projections plain linears."""
    indexer = dedent("""\
        class Indexer(nn.Module):
            def __init__(self, config, layer_idx, infer_config, comm_manager=None, prefix=""):
                super().__init__()
                self.q_proj = nn.Linear(config.hidden_size, config.index_n_heads * 16, bias=False)
                self.k_proj = nn.Linear(config.hidden_size, 16, bias=False)
                self.index_cache = IndexKeyCache(16)

            def forward(self, hidden_states, *, forward_metadata):
                return self.index_cache(self.k_proj(hidden_states), forward_metadata)


        """)
    code = indexer + BEFORE.replace(
        "self.attn(query_states, key_states, value_states, forward_metadata)",
        "self.attn(query_states, key_states, value_states, forward_metadata, selected=picks)",
    )
    out = _sharded(run_rule, make_ctx, code)
    assert out.startswith("from runtime.layers.head_shard import head_share\n" + IMPORTS)
    assert indexer in out
    assert (
        'scale=self.head_dim**-0.5,\n            head_share=head_share(comm_manager, "attn_tp_group"),\n        )'
        in out
    )
    assert "head_share" not in _sharded(run_rule, make_ctx, BEFORE)


HEADS_READ = BEFORE.replace(
    "        # projections\n",
    "        self.num_heads = config.num_attention_heads\n        self.num_kv_heads = config.num_key_value_heads\n",
).replace(
    "        attn_output = self.o_proj(attn_output.reshape(*hidden_shape[:-2], -1))\n",
    "        attn_output = attn_output.reshape(*hidden_shape[:-2], self.num_heads * self.head_dim)\n"
    "        assert key_states.shape[1] == self.num_kv_heads\n"
    "        attn_output = self.o_proj(attn_output)\n",
)
assert HEADS_READ.count("self.num_heads * self.head_dim") == 1


def test_head_counts_read_by_forward_become_this_ranks(run_rule, make_ctx):
    """A head count forward reads as `self.x` is set to this rank's share at the end of __init__: the layers built
    before from the whole count are sharded by their own class."""
    out = _sharded(run_rule, make_ctx, HEADS_READ)
    assert (
        "        self.num_heads = self.qkv_proj.num_heads\n"
        "        self.num_kv_heads = self.qkv_proj.num_kv_heads\n"
        '        self.tp_region = TPRegion(comm_manager, "attn_tp_group", whole_sequence=True)\n'
    ) in out
    assert "reshape(*hidden_shape[:-2], self.num_heads * self.head_dim)" in out  # forward unchanged


def test_head_count_read_but_set_other_than_once_is_a_finding(run_rule, make_ctx):
    code = HEADS_READ.replace(
        "        self.num_kv_heads = config.num_key_value_heads\n",
        "        self.num_kv_heads = config.num_key_value_heads\n        self.num_kv_heads //= 1\n",
    )
    assert "whole model's `num_kv_heads`" in _finding(run_rule, make_ctx, code)


BLOOM_BEFORE = dedent("""\
    class BloomAttention(nn.Module):
        def __init__(self, config, layer_idx, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.num_heads = config.n_head
            self.head_dim = config.hidden_size // self.num_heads
            if self.head_dim * self.num_heads != config.hidden_size:
                raise ValueError(f"hidden_size must be divisible by num_heads ({self.num_heads})")
            self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
            self.k_norm = nn.LayerNorm(config.hidden_size // self.num_heads)
            self.dense = nn.Linear(config.hidden_size, config.hidden_size)
            self.attn = Attention(
                num_heads=config.n_head, head_dim=self.head_dim, scale=1.0, alibi_slopes=alibi_slopes(config.n_head)
            )

        def _reshape(self, fused_qkv):
            batch_size, seq_length, _ = fused_qkv.shape
            fused_qkv = fused_qkv.view(batch_size, seq_length, self.num_heads, 3, self.head_dim)
            return fused_qkv[..., 0, :], self.k_norm(fused_qkv[..., 1, :]), fused_qkv[..., 2, :]

        def forward(self, hidden_states, *, forward_metadata, **kwargs):
            fused_qkv = self.query_key_value(hidden_states)
            query, key, value = self._reshape(fused_qkv)
            context = self.attn(query, key, value, forward_metadata)
            return self.dense(context.reshape(*context.shape[:-2], self.num_heads * self.head_dim))
    """)


def test_qkv_viewed_per_head_in_a_helper_is_split_by_whole_heads(run_rule, make_ctx):
    """BLOOM / Persimmon: the fused output reaches a helper that views it [.., heads, 3, head_dim]; the helper's
    head count becomes a rank's, the per-head LayerNorm (sized by a division by the heads) stays whole, the
    ALiBi slopes keep this rank's heads."""
    ctx = make_ctx()
    out = _sharded(run_rule, make_ctx, BLOOM_BEFORE, ctx)
    assert (
        ctx.rewrites[0] == "BloomAttention: query_key_value -> ColumnParallelLinear by heads (attn_tp_group)"
    )
    assert 'self.num_heads = local_heads(self.num_heads, comm_manager, "attn_tp_group")\n' in out
    assert 'alibi_slopes=local_share(alibi_slopes(config.n_head), comm_manager, "attn_tp_group")' in out
    assert "self.k_norm = nn.LayerNorm(config.hidden_size // self.num_heads)" in out


def test_qkv_shape_built_from_its_size_is_split_by_whole_heads(run_rule, make_ctx):
    # GPT-NeoX-Japanese: `qkv.view(*(qkv.size()[:-1] + (heads, 3 * head_size)))`
    code = BLOOM_BEFORE.replace(
        "            query, key, value = self._reshape(fused_qkv)\n",
        "            shape = fused_qkv.size()[:-1] + (self.num_heads, 3 * self.head_dim)\n"
        "            fused_qkv = fused_qkv.view(*shape)\n"
        "            query, key, value = fused_qkv.chunk(3, dim=-1)\n",
    )
    ctx = make_ctx()
    out = run_rule(rule, code, ctx)
    assert ctx.findings == [] and "ColumnParallelLinear by heads" in ctx.rewrites[0]
    assert 'self.num_heads = local_heads(self.num_heads, comm_manager, "attn_tp_group")' in out


def test_qkv_viewed_in_blocks_first_is_not_split_by_heads(run_rule, make_ctx):
    # [.., 3, heads, head_dim]: the rows are q, k, v blocks, not whole heads
    code = BLOOM_BEFORE.replace(
        "seq_length, self.num_heads, 3, self.head_dim", "seq_length, 3, self.num_heads, self.head_dim"
    )
    what = _finding(run_rule, make_ctx, code, "BloomAttention")
    assert "`self.query_key_value` is q/k/v fused on disk" in what


def test_qkv_chunked_in_blocks_after_an_elementwise_clamp_is_split_per_rank(run_rule, make_ctx):
    # MPT: `if self.clip_qkv: qkv = qkv.clamp(...)`, then `q, k, v = qkv.chunk(3, dim=2)` (equal [q; k; v] blocks)
    code = PHI3_BEFORE.replace(
        "        query_pos = self.config.num_attention_heads * self.head_dim\n"
        "        query_states = qkv[..., :query_pos]\n"
        "        key_states = qkv[..., query_pos : query_pos + self.num_key_value_heads * self.head_dim]\n"
        "        value_states = qkv[..., query_pos + self.num_key_value_heads * self.head_dim :]\n",
        "        if self.config.clip_qkv:\n"
        "            qkv = qkv.clamp(min=-self.config.clip_qkv, max=self.config.clip_qkv)\n"
        "        query_states, key_states, value_states = qkv.chunk(3, dim=2)\n",
    )
    assert code != PHI3_BEFORE
    out = _sharded(run_rule, make_ctx, code)
    assert (
        "query_states, key_states, value_states = qkv.split(self.qkv_proj.output_partition_sizes, dim=2)"
        in out
    )
    assert "qkv = qkv.clamp(min=-self.config.clip_qkv, max=self.config.clip_qkv)" in out
    mixed = code.replace(
        "qkv.clamp(min=-self.config.clip_qkv,", "qkv.clamp(min=qkv.mean(),"
    )  # not element-wise
    assert "other than as 3 consecutive slices" in _finding(run_rule, make_ctx, mixed, "Phi3Attention")


RESIDUAL_BEFORE = BLOOM_BEFORE.replace(
    "def forward(self, hidden_states, *, forward_metadata, **kwargs):",
    "def forward(self, hidden_states, residual, *, forward_metadata, **kwargs):",
).replace(
    "        return self.dense(context.reshape(*context.shape[:-2], self.num_heads * self.head_dim))\n",
    "        output = self.dense(context.reshape(*context.shape[:-2], self.num_heads * self.head_dim))\n"
    "        output = dropout_add(output, residual, 0.0, self.training)\n"
    "        return output\n",
)


def test_residual_added_after_the_output_projection_is_added_to_the_sums(run_rule, make_ctx):
    """BLOOM adds the residual inside attention: the TPRegion reduces right after the output projection, and the
    residual (in the rank's own token layout, like the sums then) is added once."""
    assert RESIDUAL_BEFORE != BLOOM_BEFORE
    out = _sharded(run_rule, make_ctx, RESIDUAL_BEFORE)
    assert "output = self.tp_region.exit(self.dense(context.reshape(" in out
    assert "output = dropout_add(output, residual, 0.0, self.training)\n        return output\n" in out


def test_hidden_states_read_after_the_output_projection_is_a_finding(run_rule, make_ctx):
    code = RESIDUAL_BEFORE.replace("dropout_add(output, residual,", "dropout_add(output, hidden_states,")
    what = _finding(run_rule, make_ctx, code, "BloomAttention")
    assert "does not return dense's output as is, nor only combine it with its other arguments" in what


def test_norm_over_every_heads_output_runs_on_every_head(run_rule, make_ctx):
    # BitNet: `attn_sub_norm` (sized hidden_size) over all heads' attention output, right before o_proj
    code = BEFORE.replace(
        "        self.attn = Attention(\n",
        "        self.attn_sub_norm = RMSNorm(config.hidden_size)\n        self.attn = Attention(\n",
    ).replace(
        "        attn_output = self.o_proj(attn_output.reshape(*hidden_shape[:-2], -1))\n",
        "        attn_output = self.attn_sub_norm(attn_output.reshape(*hidden_shape[:-2], -1))\n"
        "        attn_output = self.o_proj(attn_output)\n",
    )
    assert code.count("attn_sub_norm") == 2
    ctx = make_ctx()
    out = _sharded(run_rule, make_ctx, code, ctx)
    assert (
        "self.attn_sub_norm = gather_heads(RMSNorm(config.hidden_size), config.num_attention_heads, comm_manager, "
        '"attn_tp_group")' in out
    )
    assert (
        "LlamaAttention: attn_sub_norm runs on every head of o_proj's input (gather_heads, attn_tp_group)"
        in (ctx.rewrites)
    )


GATED = BEFORE.replace(
    "        self.attn = Attention(\n",
    "        self.gate_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)\n"
    "        self.attn = Attention(\n",
).replace(
    "        attn_output = self.o_proj(",
    "        attn_output = attn_output * torch.sigmoid(self.gate_proj(hidden_states))\n"
    "        attn_output = self.o_proj(",
)


def test_output_gate_per_query_head_is_split_by_heads(run_rule, make_ctx):
    # AFMoE: gate_proj, built like q_proj, gates each query head's channels of the attention output.
    ctx = make_ctx()
    out = _sharded(run_rule, make_ctx, GATED, ctx)
    assert (
        "        self.gate_proj = ColumnParallelLinear(config.hidden_size, config.num_attention_heads * self.head_dim, "
        'bias=False, comm_manager=comm_manager, tp_group="attn_tp_group", prefix=join_prefix(prefix, "gate_proj"))\n'
        in out
    )
    assert "attn_output * torch.sigmoid(self.gate_proj(hidden_states))" in out
    assert ctx.rewrites[-1] == (
        "LlamaAttention: gate_proj -> ColumnParallelLinear by query heads, like q_proj (attn_tp_group)"
    )


def test_gate_per_query_head_sized_through_a_local_is_split_by_heads(run_rule, make_ctx):
    # Laguna: one gate per head (or per head channel), its size set in a local first.
    code = GATED.replace(
        "        self.gate_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)\n",
        "        gate_dim = config.num_attention_heads if config.gate_per_head else config.num_attention_heads * self.head_dim\n"
        "        self.gate_proj = nn.Linear(config.hidden_size, gate_dim, bias=False)\n",
    )
    out = _sharded(run_rule, make_ctx, code)
    assert "self.gate_proj = ColumnParallelLinear(config.hidden_size, gate_dim, bias=False, " in out


@pytest.mark.parametrize(
    "size",
    [
        "config.num_key_value_heads * self.head_dim",  # the key heads'
        "config.num_attention_heads * self.head_dim + config.num_key_value_heads",  # key heads too
    ],
)
def test_gate_sized_otherwise_than_by_query_heads_is_a_finding(run_rule, make_ctx, size):
    code = GATED.replace(
        "nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)",
        f"nn.Linear(config.hidden_size, {size}, bias=False)",
    )
    assert "`self.gate_proj = nn.Linear(" in _finding(run_rule, make_ctx, code)


def test_a_module_sized_for_all_heads_through_a_local_is_a_finding(run_rule, make_ctx):
    code = GATED.replace(
        "        self.gate_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)\n",
        "        width = config.num_attention_heads * self.head_dim\n"
        "        self.gate_norm = RMSNorm(width)\n"
        "        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)\n",
    ).replace(
        "torch.sigmoid(self.gate_proj(hidden_states))",
        "torch.sigmoid(self.gate_norm(self.gate_proj(hidden_states)))",
    )
    assert "`self.gate_norm = RMSNorm(width)`" in _finding(run_rule, make_ctx, code)


def test_gate_bias_per_query_head_keeps_this_ranks_heads(run_rule, make_ctx):
    # Beam: one gate bias per query head, broadcast over the heads of the gate.
    code = GATED.replace(
        "        self.attn = Attention(\n",
        "        self.gate_bias = nn.Parameter(torch.zeros(config.num_attention_heads))\n        self.attn = Attention(\n",
    ).replace(
        "torch.sigmoid(self.gate_proj(hidden_states))",
        "torch.sigmoid(self.gate_proj(hidden_states) + self.gate_bias[None, :, None])",
    )
    ctx = make_ctx()
    out = _sharded(run_rule, make_ctx, code, ctx)
    assert (
        "        self.gate_bias = shard_heads(nn.Parameter(torch.zeros(config.num_attention_heads)), comm_manager, "
        '"attn_tp_group")\n' in out
    )
    assert "LlamaAttention: gate_bias -> this rank's heads (shard_heads, attn_tp_group)" in ctx.rewrites


@pytest.mark.parametrize(
    "use, size",
    [
        ("self.gate_bias[None, :, None]", "config.num_key_value_heads"),  # sized by the key heads
        ("self.gate_bias[None, :, :]", "config.num_attention_heads"),  # two axes kept: not one per head
        ("self.gate_bias.sum()", "config.num_attention_heads"),  # every head together
    ],
)
def test_per_head_parameter_not_broadcast_per_query_head_is_a_finding(run_rule, make_ctx, use, size):
    code = GATED.replace(
        "        self.attn = Attention(\n",
        f"        self.gate_bias = nn.Parameter(torch.zeros({size}))\n        self.attn = Attention(\n",
    ).replace(
        "torch.sigmoid(self.gate_proj(hidden_states))",
        f"torch.sigmoid(self.gate_proj(hidden_states) + {use})",
    )
    assert "`self.gate_bias = nn.Parameter(" in _finding(run_rule, make_ctx, code)


# Gemma 3n, shortened: layers that reuse an earlier layer's keys and values build no k_proj / v_proj.
KV_SHARED = BEFORE.replace(
    "        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=True)\n"
    "        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=True)\n",
    '        self.is_kv_shared_layer = config.kv_sharing_modes[layer_idx] == "reuse"\n'
    "        if not self.is_kv_shared_layer:\n"
    "            self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=True)\n"
    "            self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=True)\n",
).replace(
    "        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)\n"
    "        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)\n",
    "        if self.is_kv_shared_layer:\n"
    '            key_states, value_states = kwargs["shared_kv_states"]\n'
    "        else:\n"
    "            key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)\n"
    "            value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)\n",
)


def test_projections_built_only_in_some_layers_are_split_by_heads_unfused(run_rule, make_ctx):
    ctx = make_ctx()
    out = _sharded(run_rule, make_ctx, KV_SHARED, ctx)
    plumbing = 'comm_manager=comm_manager, tp_group="attn_tp_group", prefix=join_prefix(prefix, "{}"))'
    assert (
        "        self.q_proj = ColumnParallelLinear(config.hidden_size, config.num_attention_heads * self.head_dim, "
        "bias=True, " + plumbing.format("q_proj") in out
    )
    assert (
        "            self.k_proj = ColumnParallelLinear(config.hidden_size, config.num_key_value_heads * "
        "self.head_dim, bias=True, " + plumbing.format("k_proj") in out
    )
    assert "self.v_proj = ColumnParallelLinear(" in out and "QKVParallelLinear" not in out
    assert 'num_kv_heads=local_heads(config.num_key_value_heads, comm_manager, "attn_tp_group")' in out
    assert (
        ctx.rewrites[0]
        == "LlamaAttention: q_proj/k_proj/v_proj -> ColumnParallelLinear by heads (attn_tp_group)"
    )


def test_projections_with_biases_of_their_own_are_split_by_heads_unfused(run_rule, make_ctx):
    """A biased query beside unbiased keys and values (one QKVParallelLinear holds one bias setting): each
    projection becomes a ColumnParallelLinear of this rank's heads, with its own bias."""
    code = BEFORE.replace(
        "* self.head_dim, bias=True)\n        self.v", "* self.head_dim, bias=False)\n        self.v"
    ).replace("* self.head_dim, bias=True)\n        self.o", "* self.head_dim, bias=False)\n        self.o")
    ctx = make_ctx()
    out = _sharded(run_rule, make_ctx, code, ctx)
    plumbing = 'comm_manager=comm_manager, tp_group="attn_tp_group", prefix=join_prefix(prefix, "{}"))'
    for name, heads, bias in (
        ("q_proj", "num_attention_heads", True),
        ("k_proj", "num_key_value_heads", False),
        ("v_proj", "num_key_value_heads", False),
    ):
        assert (
            f"self.{name} = ColumnParallelLinear(config.hidden_size, config.{heads} * self.head_dim, "
            f"bias={bias}, " + plumbing.format(name) in out
        )
    assert "QKVParallelLinear" not in out
    assert (
        ctx.rewrites[0]
        == "LlamaAttention: q_proj/k_proj/v_proj -> ColumnParallelLinear by heads (attn_tp_group)"
    )


def test_head_counts_set_from_the_config_after_the_projections_are_set_before_them(run_rule, make_ctx):
    """nanoGPT sets `self.n_head = config.n_head` after `self.c_attn`: the line moves up, to where the fused
    projection is built from this rank's heads."""
    code = BEFORE.replace("head_dim=self.head_dim", "head_dim=self.head_dim2").replace(
        "        self.attn = Attention(",
        "        self.head_dim2 = config.head_dim\n        self.attn = Attention(",
    )
    out = _sharded(run_rule, make_ctx, code)
    assert out.count("self.head_dim2 = config.head_dim") == 1
    assert out.index("self.head_dim2 = config.head_dim") < out.index("self.qkv_proj = QKVParallelLinear(")
    assert "QKVParallelLinear(config.hidden_size, self.head_dim2," in out


def test_a_projection_assigned_twice_is_a_finding(run_rule, make_ctx):
    code = KV_SHARED.replace(
        "        self.o_proj = nn.Linear(",
        "        else:\n"
        "            self.k_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim)\n"
        "        self.o_proj = nn.Linear(",
    )
    assert "`self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads" in _finding(
        run_rule, make_ctx, code
    )


def test_an_output_projection_named_otherwise_is_the_linear_called_after_attention(run_rule, make_ctx):
    # ModernBERT-decoder: `Wo`.
    ctx = make_ctx()
    out = _sharded(run_rule, make_ctx, BEFORE.replace("o_proj", "Wo"), ctx)
    assert "        self.Wo = RowParallelLinear(config.num_attention_heads * self.head_dim, " in out
    assert "return self.tp_region.exit(attn_output)" in out
    assert ctx.rewrites[1] == "LlamaAttention: Wo -> RowParallelLinear (attn_tp_group)"


def test_two_linears_called_after_attention_leave_the_output_projection_unknown(run_rule, make_ctx):
    code = GATED.replace("o_proj", "Wo")  # the gate is called after attention too
    assert "no `self.o_proj = nn.Linear(...)` in __init__" in _finding(run_rule, make_ctx, code)


# Llama's original layout, shortened: wq / wk / wv / wo, rotary embedding applied to q and k together.
WQKV = (
    BEFORE.replace("q_proj", "wq")
    .replace("k_proj", "wk")
    .replace("v_proj", "wv")
    .replace("o_proj", "wo")
    .replace(
        "        attn_output = self.attn(",
        "        query_states, key_states = rope(query_states, key_states, position_embeddings)\n"
        "        attn_output = self.attn(",
    )
)


def test_projections_named_otherwise_are_found_by_what_reaches_attention(run_rule, make_ctx):
    ctx = make_ctx()
    out = _sharded(run_rule, make_ctx, WQKV, ctx)
    assert "        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, " in out
    assert "        self.wo = RowParallelLinear(" in out
    assert "wq_out, wk_out, wv_out = self.qkv_proj(hidden_states).split(" in out
    assert ctx.rewrites[:2] == [
        "LlamaAttention: wq/wk/wv -> QKVParallelLinear qkv_proj (attn_tp_group)",
        "LlamaAttention: wo -> RowParallelLinear (attn_tp_group)",
    ]
    assert ctx.fused == [(".qkv_proj", ".wq", "q"), (".qkv_proj", ".wk", "k"), (".qkv_proj", ".wv", "v")]


def test_projections_called_on_an_alias_of_the_same_input_fuse(run_rule, make_ctx):
    # BioGPT once its cross-attention input is folded away: `current_states = hidden_states`.
    code = BEFORE.replace(
        "        key_states = self.k_proj(hidden_states)",
        "        current_states = hidden_states\n        key_states = self.k_proj(current_states)",
    ).replace("self.v_proj(hidden_states)", "self.v_proj(current_states)")
    out = _sharded(run_rule, make_ctx, code)
    assert "q_proj_out, k_proj_out, v_proj_out = self.qkv_proj(hidden_states).split(" in out


GPT2_BEFORE = dedent("""\
    class GPT2Attention(nn.Module):
        def __init__(self, config, infer_config=None, comm_manager=None, prefix=""):
            super().__init__()
            self.embed_dim = config.hidden_size
            self.head_dim = self.embed_dim // config.num_attention_heads
            self.split_size = self.embed_dim
            self.c_attn = Conv1D(3 * self.embed_dim, self.embed_dim)
            self.c_proj = Conv1D(self.embed_dim, self.embed_dim)
            self.attn = Attention(num_heads=config.num_attention_heads, head_dim=self.head_dim)

        def forward(self, hidden_states, *, forward_metadata):
            query_states, key_states, value_states = self.c_attn(hidden_states).split(self.split_size, dim=2)
            attn_output = self.attn(query_states, key_states, value_states, forward_metadata)
            return self.c_proj(attn_output)
    """)


def test_conv1d_projections_load_their_weights_transposed(run_rule, make_ctx):
    # GPT-2: transformers' Conv1D(nf, nx) stores [in, out]; c_attn is [q; k; v] cut by `.split(n, dim)` on the call
    ctx = make_ctx()
    out = _sharded(run_rule, make_ctx, GPT2_BEFORE, ctx)
    assert (
        "self.c_attn = QKVParallelLinear(self.embed_dim, self.head_dim, config.num_attention_heads, "
        "config.num_attention_heads, bias=True, transposed_on_disk=True," in out
    )
    assert (
        "self.c_proj = RowParallelLinear(self.embed_dim, self.embed_dim, bias=True, transposed_on_disk=True, "
        "reduce_results=False," in out
    )
    assert (
        "query_states, key_states, value_states = self.c_attn(hidden_states).split("
        "self.c_attn.output_partition_sizes, dim=2)" in out
    )
    assert "Conv1D" not in out and ctx.fused == []
    # GPT-1: the output bound first, split later
    bound = GPT2_BEFORE.replace(
        "        query_states, key_states, value_states = self.c_attn(hidden_states).split(self.split_size, dim=2)\n",
        "        qkv = self.c_attn(hidden_states)\n"
        "        query_states, key_states, value_states = qkv.split(self.split_size, dim=2)\n",
    )
    assert bound != GPT2_BEFORE
    assert "= qkv.split(self.c_attn.output_partition_sizes, dim=2)" in _sharded(run_rule, make_ctx, bound)


@pytest.mark.parametrize(
    "cut",
    [
        "torch.split(self.c_attn(hidden_states), self.split_size, dim=2)",  # a function the rule does not read
        "self.c_attn(hidden_states).split(self.split_size, dim=2)[:3]",  # not unpacked into three names
    ],
)
def test_fused_conv1d_cut_otherwise_is_a_finding(run_rule, make_ctx, cut):
    code = GPT2_BEFORE.replace("self.c_attn(hidden_states).split(self.split_size, dim=2)", cut)
    assert "`self.c_attn` is q/k/v fused on disk, and forward" in _finding(
        run_rule, make_ctx, code, "GPT2Attention"
    )


WIDTH_READ = BEFORE.replace(
    "        # projections\n", "        self.embed_dim = config.num_attention_heads * self.head_dim\n"
).replace(
    "        attn_output = self.o_proj(attn_output.reshape(*hidden_shape[:-2], -1))\n",
    "        attn_output = attn_output.transpose(1, 2)\n"
    "        attn_output = self.o_proj(attn_output.reshape(*hidden_shape[:-2], self.embed_dim))\n",
)


def test_output_width_read_between_attention_and_output_projection_becomes_this_ranks(run_rule, make_ctx):
    # XGLM reshapes the attention output to `self.embed_dim` for its output projection: a rank holds its heads'
    # share of that width
    out = _sharded(run_rule, make_ctx, WIDTH_READ)
    assert (
        '        self.embed_dim = local_width(self.embed_dim, comm_manager, "attn_tp_group")\n'
        '        self.tp_region = TPRegion(comm_manager, "attn_tp_group", whole_sequence=True)\n'
    ) in out
    assert "from runtime.layers.head_shard import local_width" in out
    assert "reshape(*hidden_shape[:-2], self.embed_dim))" in out  # forward unchanged


@pytest.mark.parametrize(
    "read",
    [
        # the input's width, read before attention
        (
            "        hidden_shape = (",
            "        assert hidden_states.shape[-1] == self.embed_dim\n        hidden_shape = (",
        ),
        # the output projection's width, read after it
        ("        return attn_output\n", "        return attn_output.view(-1, self.embed_dim)\n"),
    ],
)
def test_a_width_read_outside_the_attention_output_is_a_finding(run_rule, make_ctx, read):
    code = WIDTH_READ.replace(*read)
    assert code != WIDTH_READ
    assert "whole model's `embed_dim`" in _finding(run_rule, make_ctx, code)


BIGCODE = dedent("""\
    class GPTBigCodeAttention(nn.Module):
        def __init__(self, config, infer_config=None, comm_manager=None, prefix=""):
            super().__init__()
            self.embed_dim = config.hidden_size
            self.head_dim = self.embed_dim // config.num_attention_heads
            self.kv_dim = self.head_dim
            self.c_attn = nn.Linear(self.embed_dim, self.embed_dim + 2 * self.kv_dim)
            self.c_proj = nn.Linear(self.embed_dim, self.embed_dim)
            self.attn = Attention(num_heads=config.num_attention_heads, head_dim=self.head_dim, num_kv_heads=1)

        def forward(self, hidden_states, *, forward_metadata, **kwargs):
            query, key, value = (
                self.c_attn(hidden_states)
                .unsqueeze(1)
                .split((self.embed_dim, self.kv_dim, self.kv_dim), dim=3)
            )
            attn_output = self.attn(query, key, value, forward_metadata)
            return self.c_proj(attn_output.reshape(*hidden_states.shape[:-1], -1))
    """)


def test_a_fused_output_given_a_head_axis_then_split_in_blocks_is_split_per_rank(run_rule, make_ctx):
    # GPT-BigCode's multi-query layout: [q; k; v] blocks, one key head (replicated on every rank under TP)
    out = _sharded(run_rule, make_ctx, BIGCODE)
    assert (
        "            self.c_attn(hidden_states)\n"
        "            .unsqueeze(1)\n"
        "            .split(self.c_attn.output_partition_sizes, dim=3)\n"
    ) in out
    assert "QKVParallelLinear(self.embed_dim, self.head_dim, config.num_attention_heads, 1, bias=True" in out


CODEGEN = dedent("""\
    class CodeGenAttention(nn.Module):
        def __init__(self, config, infer_config=None, comm_manager=None, prefix=""):
            super().__init__()
            self.embed_dim = config.hidden_size
            self.head_dim = self.embed_dim // config.num_attention_heads
            self.out_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=False)
            self.qkv_proj = nn.Linear(self.embed_dim, self.embed_dim * 3, bias=False)
            self.mp_num = 4
            self.attn = Attention(num_heads=config.num_attention_heads, head_dim=self.head_dim)

        def forward(self, hidden_states, *, forward_metadata, **kwargs):
            input_shape = hidden_states.shape[:-1]
            hidden_shape = (*input_shape, -1, self.head_dim)
            local_dim = self.embed_dim // self.mp_num
            qkv = self.qkv_proj(hidden_states).view(*input_shape, -1, 3 * local_dim)
            query, value, key = qkv.split(local_dim, dim=-1)
            attn_output = self.attn(query.reshape(hidden_shape), key.reshape(hidden_shape), value, forward_metadata)
            return self.out_proj(attn_output.reshape(*input_shape, -1))
    """)


def test_qkv_in_blocks_of_a_fixed_width_is_split_by_whole_blocks(run_rule, make_ctx):
    # CodeGen lays qkv_proj out in mp_num blocks, each q, v and k of a quarter of the heads, and views its output
    # per block: the block width stays the whole model's, and a rank's contiguous rows must be whole blocks
    ctx = make_ctx()
    out = run_rule(rule, CODEGEN, ctx)
    assert ctx.findings == [] and ctx.rewrites[0].startswith(
        "CodeGenAttention: qkv_proj -> ColumnParallelLinear"
    )
    assert (
        "        self.qkv_proj = ColumnParallelLinear(self.embed_dim, self.embed_dim * 3, bias=False, "
        'comm_manager=comm_manager, tp_group="attn_tp_group", prefix=join_prefix(prefix, "qkv_proj"))\n'
    ) in out
    assert (
        '        whole_blocks(self.embed_dim * 3, 3 * (self.embed_dim // self.mp_num), comm_manager, "attn_tp_group")\n'
    ) in out
    assert "from runtime.layers.head_shard import local_heads, whole_blocks" in out
    assert "        local_dim = self.embed_dim // self.mp_num\n" in out  # forward unchanged
    again = make_ctx()
    assert run_rule(rule, out, again) == out and again.findings == []


def test_blocks_whose_width_depends_on_the_input_are_a_finding(run_rule, make_ctx):
    code = CODEGEN.replace(
        "local_dim = self.embed_dim // self.mp_num", "local_dim = hidden_states.shape[-1] // 4"
    )
    assert code != CODEGEN
    assert "depends on the input" in _finding(run_rule, make_ctx, code, "CodeGenAttention")


def test_a_whole_model_width_read_beside_the_blocks_is_a_finding(run_rule, make_ctx):
    code = CODEGEN.replace("reshape(*input_shape, -1))", "reshape(*input_shape, self.embed_dim))")
    assert code != CODEGEN
    assert "whole model's `embed_dim`" in _finding(run_rule, make_ctx, code, "CodeGenAttention")


# BART-style attention (TrOCR's), as migrated: key / value widths folded to the model width through locals, and
# the attention output reshaped to the width forward reads off its input.
BART = dedent("""\
    class TrOCRAttention(nn.Module):
        def __init__(self, config, embed_dim, num_heads, bias=True, infer_config=None, comm_manager=None, prefix=""):
            super().__init__()
            kdim = embed_dim
            vdim = embed_dim
            self.num_heads = num_heads
            self.head_dim = embed_dim // num_heads
            self.k_proj = nn.Linear(kdim, embed_dim, bias=bias)
            self.v_proj = nn.Linear(vdim, embed_dim, bias=bias)
            self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
            self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
            self.attn = Attention(num_heads=num_heads, head_dim=self.head_dim, scale=1.0)

        def forward(self, hidden_states, *, forward_metadata, **kwargs):
            bsz, tgt_len, embed_dim = hidden_states.size()
            query_states = self.q_proj(hidden_states).view(bsz, tgt_len, self.num_heads, self.head_dim)
            key_states = self.k_proj(hidden_states).view(bsz, -1, self.num_heads, self.head_dim)
            value_states = self.v_proj(hidden_states).view(bsz, -1, self.num_heads, self.head_dim)
            attn_output = self.attn(query_states, key_states, value_states, forward_metadata)
            attn_output = attn_output.reshape(bsz, tgt_len, embed_dim)
            return self.out_proj(attn_output)
    """)


def test_key_value_widths_through_locals_and_the_input_width_of_the_output_shard_by_heads(run_rule, make_ctx):
    out = _sharded(run_rule, make_ctx, BART)
    assert "kdim" not in out and "vdim" not in out  # folded into the one projection, then unused
    assert (
        "self.qkv_proj = QKVParallelLinear(embed_dim, self.head_dim, num_heads, num_heads, bias=bias" in out
    )
    assert "attn_output = attn_output.reshape(bsz, tgt_len, -1)\n" in out  # a rank holds its heads' share


def test_the_input_width_read_otherwise_after_attention_is_a_finding(run_rule, make_ctx):
    code = BART.replace(
        "        return self.out_proj(attn_output)\n",
        "        return self.out_proj(attn_output) * embed_dim\n",
    )
    assert "sizes the attention output by its input's width `embed_dim`" in _finding(
        run_rule, make_ctx, code, "TrOCRAttention"
    )


def test_a_head_size_computed_from_the_input_width_is_left_for_the_view_to_infer(run_rule, make_ctx):
    """nanoGPT views each head by `C // self.n_head`, C the input's width: whole on every rank, while the head
    count becomes this rank's, so the head size is left to view, `-1`."""
    code = BART.replace(
        "view(bsz, tgt_len, self.num_heads, self.head_dim)",
        "view(bsz, tgt_len, self.num_heads, embed_dim // self.num_heads)",
    )
    out = _sharded(run_rule, make_ctx, code)
    assert "view(bsz, tgt_len, self.num_heads, -1)" in out and "embed_dim // self.num_heads)" not in out
    # a view that already leaves a size to infer cannot leave the head size too
    both = code.replace(
        "view(bsz, tgt_len, self.num_heads, embed_dim", "view(bsz, -1, self.num_heads, embed_dim"
    )
    assert "sizes heads by its input's width `embed_dim`" in _finding(
        run_rule, make_ctx, both, "TrOCRAttention"
    )
    # read otherwise before attention: a finding
    mixed = code.replace(
        "        attn_output = self.attn(",
        "        query_states = query_states * (embed_dim // self.num_heads)\n        attn_output = self.attn(",
    )
    assert "sizes heads by its input's width `embed_dim`" in _finding(
        run_rule, make_ctx, mixed, "TrOCRAttention"
    )


# Falcon's attention as PR008 leaves it for a multi-query checkpoint: [q heads; one key head; one value head] on
# disk, viewed in a helper (the other layouts guarded), a rotary and an ALiBi Attention on one cache.
FALCON = dedent("""\
    class FalconAttention(nn.Module):
        def __init__(self, config, layer_idx=None, infer_config=None, comm_manager=None, prefix=""):
            super().__init__()
            self.num_heads = config.num_attention_heads
            self.head_dim = config.hidden_size // self.num_heads
            if config.multi_query:
                qkv_out_dim = config.hidden_size + 2 * self.head_dim
            else:
                qkv_out_dim = 3 * config.hidden_size
            self.query_key_value = nn.Linear(config.hidden_size, qkv_out_dim, bias=config.bias)
            self.multi_query = config.multi_query
            self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.bias)
            self.num_kv_heads = config.num_kv_heads if not self.multi_query else 1
            self.attn = Attention(num_heads=config.num_attention_heads, head_dim=self.head_dim, num_kv_heads=self.num_kv_heads, scale=1.0)
            self.attn_2 = Attention(num_heads=config.num_attention_heads, head_dim=self.head_dim, num_kv_heads=self.num_kv_heads, scale=1.0, alibi_slopes=alibi_slopes(config.num_attention_heads), cache_of=self.attn)

        def _split_heads(self, fused_qkv):
            if not self.multi_query:
                raise NotImplementedError("parallelized for a checkpoint where `not self.multi_query` is false")
            else:
                batch_size, seq_length, _ = fused_qkv.shape
                fused_qkv = fused_qkv.view(batch_size, seq_length, self.num_heads + 2, self.head_dim)
                return fused_qkv[..., :-2, :], fused_qkv[..., [-2], :], fused_qkv[..., [-1], :]

        def forward(self, hidden_states, *, forward_metadata, **kwargs):
            fused_qkv = self.query_key_value(hidden_states)
            (query_layer, key_layer, value_layer) = self._split_heads(fused_qkv)
            key_layer = key_layer.reshape(*key_layer.shape[:-2], self.num_kv_heads, self.head_dim)
            attn_output = self.attn(query_layer, key_layer, value_layer, forward_metadata)
            attn_output = self.dense(attn_output.reshape(*hidden_states.shape[:-1], -1))
            return attn_output
    """)


def test_a_multi_query_projection_viewed_in_a_helper_keeps_its_key_head_whole_on_every_rank(
    run_rule, make_ctx
):
    out = _sharded(run_rule, make_ctx, FALCON)
    assert "qkv_out_dim" not in out  # bound per layout for the whole model's layer, now unused
    assert (
        "self.query_key_value = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads, 1,"
        in out
    )
    # both runtime Attention layers take this rank's heads (the ALiBi one its heads' slopes); kv heads replicated
    assert out.count("num_heads=self.query_key_value.num_heads") == 2
    assert 'local_share(alibi_slopes(config.num_attention_heads), comm_manager, "attn_tp_group")' in out
    assert 'self.num_kv_heads = local_kv_heads(self.num_kv_heads, comm_manager, "attn_tp_group")' in out
    assert "self.num_heads + 2, self.head_dim)" in out  # the helper reads this rank's heads, unchanged


def test_a_multi_query_view_read_by_its_width_is_split_otherwise(run_rule, make_ctx):
    # the fused output read other than by its shape before the view: not known to be whole heads
    code = FALCON.replace(
        "            batch_size, seq_length, _ = fused_qkv.shape\n",
        "            batch_size, seq_length, _ = fused_qkv.shape\n            fused_qkv[..., :64].sum()\n",
    )
    assert "is q/k/v fused on disk" in _finding(run_rule, make_ctx, code, "FalconAttention")


# Falcon's grouped layout (new_decoder_architecture) as PR008 leaves it: blocks of a key head's query heads, its key
# and its value, viewed with the heads per key head, the key broadcast to every query head.
FALCON_GROUPED = FALCON.replace(
    """        if not self.multi_query:
            raise NotImplementedError("parallelized for a checkpoint where `not self.multi_query` is false")
        else:
            batch_size, seq_length, _ = fused_qkv.shape
            fused_qkv = fused_qkv.view(batch_size, seq_length, self.num_heads + 2, self.head_dim)
            return fused_qkv[..., :-2, :], fused_qkv[..., [-2], :], fused_qkv[..., [-1], :]
""",
    """        if not self.new_decoder_architecture:
            raise NotImplementedError("parallelized for a checkpoint where `self.new_decoder_architecture` is true")
        batch, seq_len, _ = fused_qkv.shape
        qkv = fused_qkv.view(batch, seq_len, -1, self.num_heads // self.num_kv_heads + 2, self.head_dim)
        query = qkv[:, :, :, :-2]
        key = torch.broadcast_to(qkv[:, :, :, [-2]], query.shape)
        value = torch.broadcast_to(qkv[:, :, :, [-1]], query.shape)
        return query.flatten(2, 3), key.flatten(2, 3), value.flatten(2, 3)
""",
).replace("num_kv_heads=self.num_kv_heads", "num_kv_heads=config.num_attention_heads")


def test_a_fused_projection_in_groups_per_key_head_is_split_by_whole_groups(run_rule, make_ctx):
    assert FALCON_GROUPED != FALCON
    out = _sharded(run_rule, make_ctx, FALCON_GROUPED)
    assert "self.query_key_value = ColumnParallelLinear(config.hidden_size, qkv_out_dim," in out
    # the heads per key head are the same on every rank holding whole groups, which __init__ checks
    assert (
        'whole_blocks(qkv_out_dim, (self.num_heads // self.num_kv_heads + 2) * self.head_dim, comm_manager, "attn_tp_group")'
        in out
    )
    assert out.count('num_heads=local_heads(config.num_attention_heads, comm_manager, "attn_tp_group")') == 2
    assert 'self.num_kv_heads = local_kv_heads(self.num_kv_heads, comm_manager, "attn_tp_group")' in out


# BERT's attention, as migrated: the output projection lives in a sibling module its parent hands the heads' output
# to (SelfOutput), which sums it with the residual and normalises.
BERT_ATTENTION = dedent("""\
    class BertSelfAttention(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.attention_head_size = config.hidden_size // config.num_attention_heads
            self.query = nn.Linear(config.hidden_size, config.hidden_size)
            self.key = nn.Linear(config.hidden_size, config.hidden_size)
            self.value = nn.Linear(config.hidden_size, config.hidden_size)
            self.attn = Attention(num_heads=config.num_attention_heads, head_dim=self.attention_head_size)

        def forward(self, hidden_states, *, forward_metadata, **kwargs):
            hidden_shape = (*hidden_states.shape[:-1], -1, self.attention_head_size)
            query_layer = self.query(hidden_states).view(hidden_shape).transpose(1, 2)
            key_layer = self.key(hidden_states).view(hidden_shape).transpose(1, 2)
            value_layer = self.value(hidden_states).view(hidden_shape).transpose(1, 2)
            attn_output = self.attn(query_layer, key_layer, value_layer, forward_metadata)
            return attn_output.reshape(*hidden_states.shape[:-1], -1)


    class BertSelfOutput(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.dense = nn.Linear(config.hidden_size, config.hidden_size)
            self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

        def forward(self, hidden_states, input_tensor):
            hidden_states = self.dense(hidden_states)
            return self.LayerNorm(hidden_states + input_tensor)


    class BertAttention(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            attention_class = BertSelfAttention
            self.self = attention_class(config, infer_config, comm_manager, join_prefix(prefix, "self"))
            self.output = BertSelfOutput(config, infer_config, comm_manager, join_prefix(prefix, "output"))

        def forward(self, hidden_states, **kwargs):
            attention_output = self.self(hidden_states, **kwargs)
            attention_output = self.output(attention_output, hidden_states)
            return attention_output
    """)


def test_output_projection_in_the_module_the_output_is_handed_to(run_rule, make_ctx):
    ctx = make_ctx()
    out = _sharded(run_rule, make_ctx, BERT_ATTENTION, ctx)
    # the attention enters the unit and returns its heads' share; SelfOutput sums the partial products right after
    # its projection, before the residual and the norm
    assert out == IMPORTS + BERT_ATTENTION.replace(
        """        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.attn = Attention(num_heads=config.num_attention_heads, head_dim=self.attention_head_size)
""",
        """        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.attention_head_size, config.num_attention_heads, config.num_attention_heads, bias=True, comm_manager=comm_manager, tp_group="attn_tp_group", prefix=join_prefix(prefix, "qkv_proj"))
        self.attn = Attention(num_heads=self.qkv_proj.num_heads, head_dim=self.attention_head_size, num_kv_heads=self.qkv_proj.num_kv_heads)
        self.tp_region = TPRegion(comm_manager, "attn_tp_group", whole_sequence=True)
""",
    ).replace(
        """        hidden_shape = (""",
        """        hidden_states = self.tp_region.enter(hidden_states)
        hidden_shape = (""",
    ).replace(
        """        query_layer = self.query(hidden_states).view(hidden_shape).transpose(1, 2)
        key_layer = self.key(hidden_states).view(hidden_shape).transpose(1, 2)
        value_layer = self.value(hidden_states).view(hidden_shape).transpose(1, 2)
""",
        """        query_out, key_out, value_out = self.qkv_proj(hidden_states).split(self.qkv_proj.output_partition_sizes, dim=-1)
        query_layer = query_out.view(hidden_shape).transpose(1, 2)
        key_layer = key_out.view(hidden_shape).transpose(1, 2)
        value_layer = value_out.view(hidden_shape).transpose(1, 2)
""",
    ).replace(
        """        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
""",
        """        self.dense = RowParallelLinear(config.hidden_size, config.hidden_size, bias=True, reduce_results=False, comm_manager=comm_manager, tp_group="attn_tp_group", prefix=join_prefix(prefix, "dense"))
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.tp_region = TPRegion(comm_manager, "attn_tp_group", whole_sequence=True)
""",
    ).replace(
        "        hidden_states = self.dense(hidden_states)\n",
        "        hidden_states = self.tp_region.exit(self.dense(hidden_states))\n",
    )
    assert ctx.rewrites == [
        "BertSelfAttention: query/key/value -> QKVParallelLinear qkv_proj (attn_tp_group)",
        (
            "BertSelfOutput: dense, the output projection BertSelfAttention's output is handed to, -> "
            "RowParallelLinear (attn_tp_group, summed in the TPRegion of BertSelfOutput)"
        ),
    ]


def test_output_projection_elsewhere_that_cannot_take_partial_heads_is_a_finding(run_rule, make_ctx):
    cases = [
        # the parent reads the heads' output again: a rank holds only its share of it
        BERT_ATTENTION.replace(
            "self.output(attention_output, hidden_states)",
            "self.output(attention_output, hidden_states) + attention_output",
        ),
        # SelfOutput normalises before its projection
        BERT_ATTENTION.replace("self.dense(hidden_states)", "self.dense(self.LayerNorm(hidden_states))"),
        # a module or a function mixes the heads after the attention
        BERT_ATTENTION.replace("return attn_output.reshape(", "return self.mix(attn_output).reshape("),
        BERT_ATTENTION.replace(
            "return attn_output.reshape(", "return F.normalize(attn_output, dim=-1).reshape("
        ),
        # SelfOutput also built under a branch
        BERT_ATTENTION.replace(
            '        self.output = BertSelfOutput(config, infer_config, comm_manager, join_prefix(prefix, "output"))\n',
            '        self.output = BertSelfOutput(config, infer_config, comm_manager, join_prefix(prefix, "output"))\n'
            "        if config.add_cross_attention:\n            self.cross = BertSelfOutput(config, infer_config)\n",
        ),
        # SelfOutput built twice: the other one may be given whole inputs
        BERT_ATTENTION
        + "\n\nclass Other(nn.Module):\n    def __init__(self):\n        self.out = BertSelfOutput(1)\n",
    ]
    for code in cases:
        assert code != BERT_ATTENTION
        assert (
            "no `self.o_proj = nn.Linear(...)` in __init__, nor one in the module its output is handed"
            in (_finding(run_rule, make_ctx, code, "BertSelfAttention"))
        )


GLM_BEFORE = dedent("""\
    class SelfAttention(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.projection_size = config.kv_channels * config.num_attention_heads
            self.head_size = self.projection_size // config.num_attention_heads
            self.heads_per_partition = config.num_attention_heads
            self.groups_per_partition = config.multi_query_group_num
            qkv_size = self.projection_size + 2 * self.head_size * config.multi_query_group_num
            self.query_key_value = nn.Linear(config.hidden_size, qkv_size, bias=True)
            self.dense = nn.Linear(self.projection_size, config.hidden_size, bias=False)
            self.attn = Attention(
                num_heads=config.num_attention_heads,
                head_dim=self.head_size,
                num_kv_heads=self.groups_per_partition,
                scale=self.head_size**-0.5,
            )

        def forward(self, hidden_states, *, forward_metadata):
            mixed = self.query_key_value(hidden_states)
            q, k, v = mixed.split(
                [
                    self.heads_per_partition * self.head_size,
                    self.groups_per_partition * self.head_size,
                    self.groups_per_partition * self.head_size,
                ],
                dim=-1,
            )
            q = q.view(q.size()[:-1] + (self.heads_per_partition, self.head_size))
            k = k.view(k.size()[:-1] + (self.groups_per_partition, self.head_size))
            v = v.view(v.size()[:-1] + (self.groups_per_partition, self.head_size))
            context = self.attn(q, k, v, forward_metadata)
            context = context.reshape(*context.size()[:-2], self.projection_size)
            return self.dense(context)
    """)


def test_head_counts_and_widths_under_names_of_their_own_become_this_ranks(run_rule, make_ctx):
    """ChatGLM: the head counts forward views q / k / v by are what the Attention call was given, under names of
    their own, and the attention output is brought to a width set as a product of a head count."""
    out = _sharded(run_rule, make_ctx, GLM_BEFORE)
    assert "self.heads_per_partition = self.query_key_value.num_heads\n" in out
    assert "self.groups_per_partition = self.query_key_value.num_kv_heads\n" in out
    assert 'self.projection_size = local_width(self.projection_size, comm_manager, "attn_tp_group")' in out
    assert "self.head_size = " not in out.split("self.attn = Attention(")[1]  # a quotient: every rank's
    keys = GLM_BEFORE.replace(  # a width of the key heads, which ranks may hold copies of: no share of it
        "self.projection_size = config.kv_channels * config.num_attention_heads",
        "self.projection_size = config.kv_channels * config.multi_query_group_num",
    )
    assert "local_width(" not in run_rule(rule, keys, make_ctx())
    unread = GLM_BEFORE.replace("self.projection_size)\n        return", "-1)\n        return")
    out = _sharded(run_rule, make_ctx, unread)  # forward no longer reads the width: it stays as built
    assert "local_width(" not in out and "self.heads_per_partition = self.query_key_value.num_heads" in out


META_BEFORE = dedent("""\
    class MetaLMAttention(nn.Module):
        def __init__(self, args, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.n_kv_heads = args.n_kv_heads
            self.n_local_heads = args.n_heads
            self.n_local_kv_heads = self.n_kv_heads
            self.head_dim = args.dim // args.n_heads
            self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
            self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
            self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
            self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
            self.attn = Attention(num_heads=self.n_local_heads, head_dim=self.head_dim, num_kv_heads=self.n_kv_heads)

        def forward(self, x, *, forward_metadata):
            bsz, seqlen, _ = x.shape
            xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
            xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
            xk = xk.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
            xv = xv.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
            output = self.attn(xq, xk, xv, forward_metadata)
            return self.wo(output.view(bsz, seqlen, -1))
    """)


def test_projections_sized_by_the_attention_s_own_head_counts_are_split_by_heads(run_rule, make_ctx):
    """Meta's reference Llama: `wq` / `wk` / `wv` sized by `args.n_heads` (what `self.n_local_heads`, the
    Attention's query heads, is set to) and `self.n_kv_heads` (its key heads): none of the names the rule knows."""
    ctx = make_ctx()
    out = _sharded(run_rule, make_ctx, META_BEFORE, ctx)
    assert ctx.rewrites[0] == "MetaLMAttention: wq/wk/wv -> ColumnParallelLinear by heads (attn_tp_group)"
    assert 'num_heads=local_heads(self.n_local_heads, comm_manager, "attn_tp_group")' in out
    assert 'self.n_local_kv_heads = local_heads(self.n_local_kv_heads, comm_manager, "attn_tp_group")' in out
    literal = META_BEFORE.replace("args.n_heads * self.head_dim, bias=False)\n", "64, bias=False)\n").replace(
        "self.n_kv_heads * self.head_dim", "32"
    )
    assert "no projection whose output size counts the heads" in _finding(
        run_rule, make_ctx, literal, "MetaLMAttention"
    )
