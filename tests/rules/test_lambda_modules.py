"""lambda_modules: minGPT's MLP, layers in an nn.ModuleDict applied through a lambda, becomes a module class holding
the same layers under the same names, built where the ModuleDict was and called where the lambda was."""

from textwrap import dedent

import pytest
from codemod_harness import assert_codemod, assert_noop

from skills.migrator.rules.lambda_modules import LambdaModules as rule

BEFORE = dedent("""\
    class Block(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.ln_2 = nn.LayerNorm(config.n_embd)
            self.mlp = nn.ModuleDict(
                dict(
                    c_fc=nn.Linear(config.n_embd, 4 * config.n_embd),
                    c_proj=nn.Linear(4 * config.n_embd, config.n_embd),
                    act=NewGELU(),
                )
            )
            m = self.mlp
            self.mlpf = lambda x: m.c_proj(m.act(m.c_fc(x)))

        def forward(self, x):
            return x + self.mlpf(self.ln_2(x))
    """)

AFTER = dedent("""\
    class BlockMlp(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
            self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
            self.act = NewGELU()

        def forward(self, x):
            return self.c_proj(self.act(self.c_fc(x)))


    class Block(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.ln_2 = nn.LayerNorm(config.n_embd)
            self.mlp = BlockMlp(config)

        def forward(self, x):
            return x + self.mlp(self.ln_2(x))
    """)


def test_a_lambda_over_a_module_dict_becomes_a_module_with_the_same_layer_names(make_ctx):
    assert_codemod(rule, BEFORE, AFTER, make_ctx)


def test_the_lambda_may_read_the_dict_through_self(make_ctx):
    before = BEFORE.replace("            m = self.mlp\n", "").replace("m.", "self.mlp.")
    assert_codemod(rule, before, AFTER, make_ctx)


@pytest.mark.parametrize(
    "change",
    [
        # the lambda reads another attribute of its owner
        ("m.c_proj(m.act(m.c_fc(x)))", "m.c_proj(m.act(m.c_fc(x))) * self.scale"),
        # the lambda calls something that is no layer of the dict
        ("m.act(m.c_fc(x))", "m.gelu(m.c_fc(x))"),
        # the owner reads the dict itself elsewhere
        ("return x + self.mlpf(self.ln_2(x))", "return x + self.mlpf(self.ln_2(x)) + self.mlp.c_fc.bias"),
        # the dict is built from a local of the owner's constructor
        ("c_fc=nn.Linear(config.n_embd, 4 * config.n_embd)", "c_fc=nn.Linear(config.n_embd, width)"),
    ],
)
def test_a_lambda_module_the_class_could_not_hold_as_written_stays(make_ctx, change):
    code = BEFORE.replace(*change)
    if "width)" in code:
        code = code.replace(
            "super().__init__()\n", "super().__init__()\n        width = 4 * config.n_embd\n", 1
        )
    assert code != BEFORE
    assert_noop(rule, code, make_ctx)
