"""comm_groups: the entry class registers the groups its parallel layers use, right after super().__init__()."""

from textwrap import dedent

from skills.parallel_impl.rules.comm_groups import RegisterCommGroups as rule

LAYERS = dedent("""\
    class LlamaMLP(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.down_proj = RowParallelLinear(2, 2, comm_manager=comm_manager, tp_group="dense_tp_group")
            self.lm_head = ParallelLMHead(8, 2, comm_manager=comm_manager, tp_group="lmhead_tp_group")


    """)

BEFORE = LAYERS + dedent("""\
    class LlamaForCausalLM(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.model = LlamaModel(config, infer_config, comm_manager, join_prefix(prefix, "model"))

        def forward(self, input_ids, position_ids, forward_metadata, **kwargs):
            return self.model(input_ids)
    """)

AFTER = (
    dedent("""\
    from runtime.config import InferenceConfig
    from runtime.config.comm_manager import CommManager, register_tp_groups

    """)
    + LAYERS
    + dedent('''\
    class LlamaForCausalLM(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.init_parallel_comm_group(infer_config, comm_manager)
            self.model = LlamaModel(config, infer_config, comm_manager, join_prefix(prefix, "model"))

        def init_parallel_comm_group(self, infer_config: InferenceConfig, comm_manager: CommManager | None) -> None:
            """Registers the process groups of this model's parallel layers (sizes from parallel_config)."""
            register_tp_groups(comm_manager, infer_config.parallel_config, ("dense_tp_group", "lmhead_tp_group"))

        def forward(self, input_ids, position_ids, forward_metadata, **kwargs):
            return self.model(input_ids)
    ''')
)


def test_groups_registered(run_rule, make_ctx):
    ctx = make_ctx()
    assert run_rule(rule, BEFORE, ctx) == AFTER
    assert ctx.rewrites == [
        "LlamaForCausalLM: init_parallel_comm_group registers dense_tp_group, lmhead_tp_group"
    ]


def test_idempotent(run_rule, make_ctx):
    ctx = make_ctx()
    assert run_rule(rule, AFTER, ctx) == AFTER
    assert ctx.rewrites == ctx.findings == []


def test_no_parallel_layers_untouched(run_rule, make_ctx):
    code = BEFORE.replace(LAYERS, "")
    ctx = make_ctx()
    assert run_rule(rule, code, ctx) == code
    assert ctx.rewrites == ctx.findings == []


def test_one_group_is_a_tuple(run_rule):
    out = run_rule(rule, BEFORE.replace('tp_group="lmhead_tp_group"', 'tp_group="dense_tp_group"'))
    assert 'infer_config.parallel_config, ("dense_tp_group",))' in out


def test_entry_without_super_init_is_a_finding(run_rule, make_ctx):
    code = BEFORE.replace("        super().__init__()\n        self.model", "        self.model")
    ctx = make_ctx()
    assert run_rule(rule, code, ctx) == code
    (finding,) = ctx.findings
    assert finding.scope == "LlamaForCausalLM" and "cannot register the parallel groups" in finding.what
