"""unread_modules: submodules nothing calls go, and the entry's loader skips their checkpoint tensors; a name a
module in use shares, or an entry that loads otherwise, leaves them."""

from textwrap import dedent

from codemod_harness import assert_codemod, assert_noop

from skills.migrator.rules.unread_modules import UnreadModules as rule

# GPT-2 after MG004 folded the encoder's states away: the cross-attention block is built, never called.
BEFORE = dedent("""\
    class GPT2Block(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.attn = GPT2Attention(config, infer_config=infer_config)
            if config.add_cross_attention:
                self.crossattention = GPT2Attention(
                    config, is_cross_attention=True, prefix=join_prefix(prefix, "crossattention")
                )
                self.ln_cross_attn = nn.LayerNorm(config.hidden_size)
            self.mlp = GPT2MLP(config)

        def forward(self, hidden_states, **kwargs):
            return self.mlp(self.attn(hidden_states, **kwargs))


    class LlamaForCausalLM(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.h = nn.ModuleList([GPT2Block(config, infer_config) for _ in range(2)])

        def forward(self, hidden_states):
            for block in self.h:
                hidden_states = block(hidden_states)
            return hidden_states

        def load_weights(self, weights):
            return load_named_weights(self, weights, ignored=["attn.bias"])
    """)

AFTER = dedent("""\
    class GPT2Block(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.attn = GPT2Attention(config, infer_config=infer_config)
            self.mlp = GPT2MLP(config)

        def forward(self, hidden_states, **kwargs):
            return self.mlp(self.attn(hidden_states, **kwargs))


    class LlamaForCausalLM(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.h = nn.ModuleList([GPT2Block(config, infer_config) for _ in range(2)])

        def forward(self, hidden_states):
            for block in self.h:
                hidden_states = block(hidden_states)
            return hidden_states

        def load_weights(self, weights):
            return load_named_weights(self, weights, ignored=["attn.bias", r"(^|\\.)crossattention\\.", r"(^|\\.)ln_cross_attn\\."])
    """)


def test_unread_modules_go_and_their_tensors_are_skipped(make_ctx):
    assert_codemod(rule, BEFORE, AFTER, make_ctx)


def test_an_ignored_list_is_started_where_there_was_none(run_rule):
    code = BEFORE.replace(', ignored=["attn.bias"]', "")
    assert 'load_named_weights(self, weights, ignored=[r"(^|\\.)crossattention\\.",' in run_rule(rule, code)


def test_modules_in_use_or_loaded_otherwise_stay(make_ctx):
    cases = [
        BEFORE.replace(  # both called
            "self.mlp(self.attn(hidden_states, **kwargs))",
            "self.ln_cross_attn(self.mlp(self.crossattention(self.attn(hidden_states, **kwargs))))",
        ),
        BEFORE.replace(
            'return load_named_weights(self, weights, ignored=["attn.bias"])', "return load(weights)"
        ),
        BEFORE.replace(  # another class names a module it uses the same: skipping `ln_cross_attn.` would lose it
            "class LlamaForCausalLM(nn.Module):",
            "class Other(nn.Module):\n"
            "    def __init__(self, config):\n"
            "        self.crossattention = nn.Linear(1, 1)\n"
            "        self.ln_cross_attn = nn.LayerNorm(1)\n\n"
            "    def forward(self, x):\n"
            "        return self.ln_cross_attn(self.crossattention(x))\n\n\n"
            "class LlamaForCausalLM(nn.Module):",
        ),
        BEFORE.replace(  # named by strings: read by getattr(self, name)
            "self.mlp(self.attn(hidden_states, **kwargs))",
            'self.mlp(self.attn(hidden_states, **kwargs)) + getattr(self, "crossattention")(getattr(self, "ln_cross_attn")(hidden_states))',
        ),
        BEFORE.replace(
            "self.crossattention = GPT2Attention(", "self.crossattention = make_attention("
        ).replace(
            "nn.LayerNorm(config.hidden_size)", "build_norm(config.hidden_size)"
        ),  # factories: not known modules
    ]
    for code in cases:
        assert code != BEFORE
        assert_noop(rule, code, make_ctx)


def test_an_unread_module_without_weights_goes_without_a_pattern(run_rule):
    # Granite's rotary embedding once its layers take positions from the runtime: buffers only, none on disk
    code = BEFORE.replace(
        "class GPT2Block(nn.Module):",
        "class RotaryEmbedding(nn.Module):\n"
        "    def __init__(self, config):\n"
        "        super().__init__()\n"
        '        self.register_buffer("inv_freq", make_inv_freq(config), persistent=False)\n\n\n'
        "class GPT2Block(nn.Module):",
    ).replace(
        "        self.mlp = GPT2MLP(config)\n",
        "        self.mlp = GPT2MLP(config)\n        self.rotary_emb = RotaryEmbedding(config)\n",
    )
    assert code.count("RotaryEmbedding(") == 2
    out = run_rule(rule, code)
    assert "self.rotary_emb" not in out and "rotary_emb\\." not in out
    assert r'r"(^|\.)crossattention\.", r"(^|\.)ln_cross_attn\."]' in out


def test_a_module_built_only_in_a_branch_the_defaults_fold_away_needs_no_pattern(run_rule):
    # GPT-2's q_attn: built when is_cross_attention, which only the dropped cross-attention block passed True
    attention = (
        "class GPT2Attention(nn.Module):\n"
        '    def __init__(self, config, is_cross_attention=False, infer_config=None, prefix=""):\n'
        "        super().__init__()\n"
        "        if is_cross_attention:\n"
        "            self.q_attn = Conv1D(config.hidden_size, config.hidden_size)\n"
        "        self.c_attn = Conv1D(3 * config.hidden_size, config.hidden_size)\n\n"
        "    def forward(self, hidden_states):\n"
        "        return self.c_attn(hidden_states)\n\n\n"
    )
    out = run_rule(rule, attention + BEFORE)
    assert "crossattention\\." in out and "q_attn\\." not in out
    assert "self.q_attn = Conv1D" not in out  # unread, it goes all the same
