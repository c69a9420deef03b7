"""stacked_params: the entry class maps the fused parameters onto their checkpoint parts for load_weights."""

from textwrap import dedent

from skills.parallel_impl.rules.stacked_params import StackedParams as rule

BEFORE = dedent('''\
    class LlamaForCausalLM(nn.Module):
        """The causal LM."""
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            return load_named_weights(self, weights)
    ''')

AFTER = dedent('''\
    class LlamaForCausalLM(nn.Module):
        """The causal LM."""
        stacked_params_mapping = ((".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"), (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))

        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            return load_named_weights(self, weights, stacked_params_mapping=self.stacked_params_mapping)
    ''')

FUSED = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]


def test_mapping_added(run_rule, make_ctx):
    ctx = make_ctx(fused=list(FUSED))
    assert run_rule(rule, BEFORE, ctx) == AFTER
    assert ctx.rewrites == [
        "LlamaForCausalLM: load_weights loads gate_up_proj, qkv_proj from their checkpoint parts"
    ]


def test_only_the_fusions_made(run_rule, make_ctx):
    out = run_rule(rule, BEFORE, make_ctx(fused=FUSED[3:]))
    assert (
        'stacked_params_mapping = ((".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))\n'
        in out
    )


def test_idempotent(run_rule, make_ctx):
    ctx = make_ctx(fused=list(FUSED))
    assert run_rule(rule, AFTER, ctx) == AFTER
    assert ctx.rewrites == ctx.findings == []


def test_nothing_fused_untouched(run_rule, make_ctx):
    ctx = make_ctx()
    assert run_rule(rule, BEFORE, ctx) == BEFORE
    assert ctx.rewrites == ctx.findings == []


def test_custom_load_weights_is_a_finding(run_rule, make_ctx):
    code = BEFORE.replace("load_named_weights(self, weights)", "my_loader(self, weights)")
    ctx = make_ctx(fused=list(FUSED))
    assert run_rule(rule, code, ctx) == code
    (finding,) = ctx.findings
    assert "could not be loaded from the checkpoint" in finding.what
