"""module_dict_model: a flat entry whose trunk sits in an nn.ModuleDict gets an inner model class holding the same
modules under the same names, and the statements before its output layer as that class's forward."""

from functools import partial
from textwrap import dedent

import pytest
from codemod_harness import assert_codemod, assert_noop

from skills.migrator.rules.module_dict_model import ModuleDictModel as rule

# nanoGPT's GPT, shortened.
BEFORE = dedent('''\
    class GPTForCausalLM(PreTrainedModel):
        def __init__(self, config):
            super().__init__(config)
            self.transformer = nn.ModuleDict(
                dict(
                    wte=nn.Embedding(config.vocab_size, config.n_embd),
                    h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                    ln_f=LayerNorm(config.n_embd, bias=config.bias),
                )
            )
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
            self.transformer.wte.weight = self.lm_head.weight

        def forward(self, idx, targets=None):
            """Logits."""
            b, t = idx.size()
            assert t <= self.config.block_size
            x = self.transformer.wte(idx)
            for block in self.transformer.h:
                x = block(x)
            x = self.transformer.ln_f(x)
            logits = self.lm_head(x)
            return CausalLMOutput(logits=logits)
    ''')

AFTER = dedent('''\
    class GPTModel(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.wte = nn.Embedding(config.vocab_size, config.n_embd)
            self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
            self.ln_f = LayerNorm(config.n_embd, bias=config.bias)

        def forward(self, idx):
            b, t = idx.size()
            assert t <= self.config.block_size
            x = self.wte(idx)
            for block in self.h:
                x = block(x)
            x = self.ln_f(x)
            return x


    class GPTForCausalLM(PreTrainedModel):
        def __init__(self, config):
            super().__init__(config)
            self.transformer = GPTModel(config)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
            self.transformer.wte.weight = self.lm_head.weight

        def forward(self, idx, targets=None):
            """Logits."""
            hidden_states = self.transformer(idx=idx)
            logits = self.lm_head(hidden_states)
            return CausalLMOutput(logits=logits)
    ''')


@pytest.fixture
def gpt_ctx(make_ctx):
    return partial(make_ctx, entry_class="GPTForCausalLM")


def test_a_trunk_in_a_module_dict_becomes_an_inner_model_with_the_same_names(gpt_ctx):
    assert_codemod(rule, BEFORE, AFTER, gpt_ctx)


def test_a_dict_literal_with_identifier_keys_is_the_same(gpt_ctx):
    code = BEFORE.replace("dict(\n", "{\n").replace(
        "            )\n        )\n", "            }\n        )\n"
    )
    for key in ("wte", "h", "ln_f"):
        code = code.replace(f"{key}=", f'"{key}": ', 1)
    assert_codemod(rule, code, AFTER, gpt_ctx)


@pytest.mark.parametrize(
    "change",
    [
        # the trunk reads another attribute of the entry, which the inner model would not have
        ("x = self.transformer.wte(idx)", "x = self.transformer.wte(idx) * self.scale"),
        # a trunk local read after the output layer
        ("return CausalLMOutput(logits=logits)", "return CausalLMOutput(logits=logits, hidden_states=x)"),
        # the dict is built from an __init__ local the inner model would not be given
        ("LayerNorm(config.n_embd,", "LayerNorm(self.width,"),
        # the module dict itself handed on, not one of its modules
        ("x = self.transformer.ln_f(x)", "x = run(self.transformer, x)"),
    ],
)
def test_a_trunk_the_inner_model_could_not_run_as_written_stays(gpt_ctx, change):
    code = BEFORE.replace(*change)
    assert code != BEFORE
    assert_noop(rule, code, gpt_ctx)


def test_an_entry_with_an_inner_model_is_left_alone(make_ctx):
    code = dedent("""\
        class LlamaForCausalLM(PreTrainedModel):
            def __init__(self, config):
                super().__init__(config)
                self.model = LlamaModel(config)
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

            def forward(self, input_ids):
                return self.lm_head(self.model(input_ids))


        class LlamaModel(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.parts = nn.ModuleDict(dict(embed=nn.Embedding(config.vocab_size, config.hidden_size)))
        """)
    assert_noop(rule, code, make_ctx)


# the same model with its trunk held by the entry itself
FLAT = dedent('''\
    class GPTForCausalLM(PreTrainedModel):
        _tied_weights_keys = {"lm_head.weight": "wte.weight"}

        def __init__(self, config):
            super().__init__(config)
            self.wte = nn.Embedding(config.vocab_size, config.n_embd)
            self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
            self.ln_f = LayerNorm(config.n_embd, bias=config.bias)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
            self.wte.weight = self.lm_head.weight

        def get_input_embeddings(self):
            return self.wte

        def forward(self, idx, targets=None):
            """Logits."""
            b, t = idx.size()
            assert t <= self.config.block_size
            x = self.wte(idx)
            for block in self.h:
                x = block(x)
            x = self.ln_f(x)
            logits = self.lm_head(x)
            return CausalLMOutput(logits=logits)
    ''')

FLAT_AFTER = AFTER.split("class GPTForCausalLM")[0] + dedent('''\
    class GPTForCausalLM(PreTrainedModel):
        # the checkpoint names the trunk's weights as this class held them (`wte.weight`)
        base_model_prefix = "model"
        _tied_weights_keys = {"lm_head.weight": "model.wte.weight"}

        def __init__(self, config):
            super().__init__(config)
            self.model = GPTModel(config)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
            self.model.wte.weight = self.lm_head.weight

        def get_input_embeddings(self):
            return self.model.wte

        def forward(self, idx, targets=None):
            """Logits."""
            hidden_states = self.model(idx=idx)
            logits = self.lm_head(hidden_states)
            return CausalLMOutput(logits=logits)
    ''')


def test_a_trunk_the_entry_holds_itself_moves_into_an_inner_model_the_checkpoint_names_as_its_prefix(gpt_ctx):
    """minGPT written flat: `self.wte`, `self.h`, `self.ln_f` go into the inner model under `model`, which the
    entry names as its `base_model_prefix` (the loader reads the checkpoint's `wte.weight` there); the entry's
    other references to them, and the names of its tied weights, follow."""
    assert_codemod(rule, FLAT, FLAT_AFTER, gpt_ctx)


@pytest.mark.parametrize(
    "change",
    [
        # the trunk reads an attribute that is no module the entry builds from its config
        ("x = self.wte(idx)", "x = self.wte(idx) * self.scale"),
        # a trunk module built from an __init__ local the inner model would not be given
        (
            "self.ln_f = LayerNorm(config.n_embd,",
            "width = config.n_embd\n        self.ln_f = LayerNorm(width,",
        ),
        # the trunk applies the output layer itself
        ("x = self.ln_f(x)", "x = self.ln_f(x) + self.lm_head.bias"),
    ],
)
def test_a_flat_trunk_the_inner_model_could_not_hold_as_written_stays(gpt_ctx, change):
    code = FLAT.replace(*change)
    assert code != FLAT
    assert_noop(rule, code, gpt_ctx)
