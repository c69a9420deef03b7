"""dead_code: unread locals, unread `self.x` attributes and `pass` beside real statements go."""

from textwrap import dedent

from codemod_harness import assert_codemod

from skills.migrator.rules.dead_code import DeadCode as rule

IMPORTS = "from transformers.modeling_rope_utils import dynamic_rope_update\n\n\n"

# LlamaAttention after runtime_attention: layer_idx, dropout rate, is_causal, num_key_value_groups are
# only read by HF's cache / eager attention, which are gone.
BEFORE = dedent("""\
    class LlamaAttention(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.config = config
            self.layer_idx = layer_idx
            self.head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
            self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
            self.scaling = self.head_dim**-0.5
            self.attention_dropout = config.attention_dropout
            self.is_causal = True
            self.attn = Attention(num_heads=config.num_attention_heads, head_dim=self.head_dim, scale=self.scaling)

        def forward(self, hidden_states, **kwargs):
            input_shape = hidden_states.shape[:-1]
            hidden_shape = (*input_shape, -1, self.head_dim)
            past_seen_tokens = 0
            shape_copy = input_shape
            attn_output = self.attn(hidden_states.view(hidden_shape))
            if attn_output is None:
                pass
            else:
                pass
                attn_output = attn_output + 1
            return attn_output.reshape(*input_shape, -1)


    class LlamaModel(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.vocab_size = config.vocab_size
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)

        def forward(self, input_ids):
            unused = self.embed_tokens(input_ids)
            return self.embed_tokens(input_ids)
    """)

AFTER = dedent("""\
    class LlamaAttention(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
            scaling = self.head_dim**-0.5
            self.attn = Attention(num_heads=config.num_attention_heads, head_dim=self.head_dim, scale=scaling)

        def forward(self, hidden_states, **kwargs):
            input_shape = hidden_states.shape[:-1]
            hidden_shape = (*input_shape, -1, self.head_dim)
            attn_output = self.attn(hidden_states.view(hidden_shape))
            if attn_output is None:
                pass
            else:
                attn_output = attn_output + 1
            return attn_output.reshape(*input_shape, -1)


    class LlamaModel(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)

        def forward(self, input_ids):
            unused = self.embed_tokens(input_ids)
            return self.embed_tokens(input_ids)
    """)


def test_dead_code_removed(run_rule):
    # Unread `self.config` goes too (only the entry class keeps it); reads of `config.vocab_size` do not keep
    # `self.vocab_size`; `unused = self.embed_tokens(...)` calls something, so it stays.
    assert run_rule(rule, BEFORE) == AFTER


def test_idempotent(run_rule):
    assert run_rule(rule, AFTER) == AFTER


def test_live_code_untouched(run_rule):
    code = dedent("""\
        class LlamaRotaryEmbedding(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.rope_type = config.rope_parameters["rope_type"]
                self.max_seq_len_cached = config.max_position_embeddings

            def forward(self, x, position_ids):
                if self.rope_type == "default":
                    pass
                else:
                    return x
                seq = self.max_seq_len_cached
                freqs = position_ids[..., None].float() * seq
                return freqs


        class LlamaDynamicRotaryEmbedding(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.config = config  # read by transformers' decorator, as are the two below
                self.original_max_seq_len = config.max_position_embeddings
                self.original_inv_freq = None

            @dynamic_rope_update
            def forward(self, x, position_ids):
                return x


        class LlamaForCausalLM(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.config = config  # the entry class keeps its config, like HF models
        """)
    assert run_rule(rule, IMPORTS + code) == IMPORTS + code


def test_attributes_only_init_reads_become_its_locals(make_ctx):
    before = dedent("""\
        class LlamaMLP(nn.Module):
            def __init__(self, config, hidden_size_hint):
                super().__init__()
                self.hidden_size = config.hidden_size  # only __init__ reads it: a local
                self.intermediate_size = config.intermediate_size
                self.hidden_size_hint = hidden_size_hint  # the name is taken in __init__: stays
                self.act = config.hidden_act  # read by forward: stays
                self.up = nn.Linear(self.hidden_size, self.intermediate_size + self.hidden_size_hint)

            def forward(self, x):
                return self.up(x) if self.act else x


        class Rotary(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.rope_type = config.rope_type
                if self.rope_type != "default":
                    raise NotImplementedError("quotes `self.rope_type`: stays")
        """)
    after = before.replace("self.hidden_size = config", "hidden_size = config")
    after = after.replace("self.intermediate_size = config", "intermediate_size = config")
    after = after.replace(
        "nn.Linear(self.hidden_size, self.intermediate_size", "nn.Linear(hidden_size, intermediate_size"
    )
    assert_codemod(rule, before, after, make_ctx)


# BLOOM's model after the attention took its ALiBi slopes itself: the tensor the model still builds (through
# torch calls and a helper of the file, reassigned once; under a switch, as Falcon's) and the accessor nothing
# calls go, with the helper.
# the entry class both sides share
ENTRY = dedent("""\


    class LlamaForCausalLM(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.model = LlamaModel(config)

        def forward(self, input_ids):
            return self.model(input_ids)
    """)

COMPUTED_BEFORE = dedent("""\
    import torch

    if is_flash_attn_available():
        pass


    def _slopes(num_heads, device):
        base = torch.full((), 0.5, device=device)
        return torch.pow(base, torch.arange(1, 1 + num_heads, device=device))


    def _finish(x):
        return x


    class LlamaModel(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_heads = config.num_attention_heads
            self.use_alibi = config.alibi
            self.embed = nn.Embedding(config.vocab_size, config.hidden_size)

        def get_input_embeddings(self):
            return self.embed

        def _get_resized_embeddings(self, old, new_num_tokens=None):
            # a transformers hook overridden: calls itself on the base, which nothing else in the file does
            return super()._get_resized_embeddings(old, new_num_tokens)

        def forward(self, input_ids):
            hidden = self.embed(input_ids)
            batch, length, _ = hidden.shape

            # ALiBi, built once for every layer
            slopes = _slopes(self.num_heads, hidden.device)
            alibi = slopes[:, None] * torch.arange(length, device=hidden.device)
            alibi = alibi.repeat(batch, 1).to(hidden.dtype)
            if self.use_alibi:  # Falcon builds it under a switch
                alibi = alibi * 2
            implementation = "flash" if is_flash_attention_requested(self.config) else "eager"
            # the last norm
            return _finish(hidden)

    """)

COMPUTED_AFTER = dedent("""\
    import torch


    def _finish(x):
        return x


    class LlamaModel(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.embed = nn.Embedding(config.vocab_size, config.hidden_size)

        def forward(self, input_ids):
            hidden = self.embed(input_ids)

            # the last norm
            return _finish(hidden)

    """)


def test_computed_locals_uncalled_methods_and_what_only_they_used_go(run_rule):
    before, after = COMPUTED_BEFORE + ENTRY, COMPUTED_AFTER + ENTRY
    assert run_rule(rule, before) == after
    assert run_rule(rule, after) == after


def test_calls_that_may_change_something_stay(run_rule):
    # A module's method, an in-place op, a collective, a helper that writes to its argument, and a method of a
    # class with a base from outside the file (which may call it) are kept, though nothing reads them.
    code = dedent("""\
        def _fill(x):
            x[0] = 1
            return x


        class LlamaModel(PreTrainedModel):
            def helper(self):
                return 1


        class LlamaForCausalLM(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.model = LlamaModel(config)

            def forward(self, input_ids, hidden):
                moved = self.model.to(hidden.device)
                doubled = hidden.mul_(2)
                reduced = torch.distributed.all_reduce(hidden)
                filled = _fill(hidden)
                return self.model(input_ids)
        """)
    assert run_rule(rule, code) == code


def test_an_if_left_with_pass_on_both_sides_goes_when_its_test_only_asks(run_rule):
    # GPTBigCode once the encoder's mask is folded away: both branches only built it.
    before = (
        dedent("""\
        class LlamaModel(nn.Module):
            def forward(self, input_ids):
                if is_flash_attention_requested(self.config):
                    pass
                else:
                    pass
                return self.embed(input_ids)
        """)
        + ENTRY
    )
    after = (
        dedent("""\
        class LlamaModel(nn.Module):
            def forward(self, input_ids):
                return self.embed(input_ids)
        """)
        + ENTRY
    )
    assert run_rule(rule, before) == after
    assert run_rule(rule, after) == after
    kept = before.replace("is_flash_attention_requested(self.config)", "self.setup(input_ids)")
    assert run_rule(rule, kept) == kept  # a test that may change something stays


def test_a_hand_built_mask_nothing_reads_goes_with_the_if_and_the_locals_only_it_read(run_rule):
    # Remote code that builds its own causal mask, once the attention calls no longer take it.
    before = (
        dedent("""\
        class LlamaModel(nn.Module):
            def forward(self, input_ids):
                past = 0
                mask = None
                if input_ids.shape[1] > 1 and past > 0:
                    total = past + input_ids.shape[1]
                    mask = torch.ones(input_ids.shape[1], total, dtype=torch.bool).tril(past).logical_not()
                return self.embed(input_ids)
        """)
        + ENTRY
    )
    after = (
        dedent("""\
        class LlamaModel(nn.Module):
            def forward(self, input_ids):
                return self.embed(input_ids)
        """)
        + ENTRY
    )
    assert run_rule(rule, before) == after
    assert run_rule(rule, after) == after
    in_place = before.replace(".tril(past)", ".tril_(past)")
    assert run_rule(rule, in_place) == in_place  # an in-place method may change what it is called on


def test_an_unread_call_of_a_method_that_only_computes_goes_with_the_method(run_rule):
    # Remote code's mask helper, once the layers no longer take the mask: the call and then the method go.
    before = (
        dedent("""\
        class LlamaModel(nn.Module):
            def _causal_mask(self, q_len, past, dtype):
                mask = torch.full((q_len, past + q_len), torch.finfo(dtype).min, dtype=dtype)
                return torch.triu(mask, diagonal=past + 1)[None, None]

            def forward(self, input_ids):
                causal = self._causal_mask(input_ids.shape[1], 0, torch.float32)
                return self.embed(input_ids)
        """)
        + ENTRY
    )
    after = (
        dedent("""\
        class LlamaModel(nn.Module):
            def forward(self, input_ids):
                return self.embed(input_ids)
        """)
        + ENTRY
    )
    assert run_rule(rule, before) == after
    assert run_rule(rule, after) == after
    kept = before.replace("return torch.triu(mask", "return torch.triu(self.bias(mask)")
    assert run_rule(rule, kept) == kept  # a method calling a module may do more than compute
