"""cache_params: a cache parameter named otherwise than transformers' is known by its use and renamed
past_key_values, in its function and at its callers' keywords."""

from textwrap import dedent

from codemod_harness import assert_codemod, assert_noop, run_codemod

from skills.migrator.rules.cache_params import CacheParams as rule

# ChatGLM's: the attention updates `kv_cache`, the block and the stack hand theirs on by keyword.
BEFORE = dedent("""\
    class SelfAttention(nn.Module):
        def forward(self, hidden_states, kv_cache=None):
            k, v = self.kv(hidden_states)
            if kv_cache is not None:
                k, v = kv_cache.update(k, v, self.layer_number)
            return self.attend(hidden_states, k, v)


    class Block(nn.Module):
        def forward(self, hidden_states, kv_cache=None):
            return self.self_attention(hidden_states, kv_cache=kv_cache)


    class Stack(nn.Module):
        def forward(self, hidden_states, kv_caches=None):
            self.kv_caches = None
            for layer in self.layers:
                hidden_states = layer(hidden_states, kv_cache=kv_caches)
            return hidden_states
    """)

AFTER = dedent("""\
    class SelfAttention(nn.Module):
        def forward(self, hidden_states, past_key_values=None):
            k, v = self.kv(hidden_states)
            if past_key_values is not None:
                k, v = past_key_values.update(k, v, self.layer_number)
            return self.attend(hidden_states, k, v)


    class Block(nn.Module):
        def forward(self, hidden_states, past_key_values=None):
            return self.self_attention(hidden_states, past_key_values=past_key_values)


    class Stack(nn.Module):
        def forward(self, hidden_states, past_key_values=None):
            self.kv_caches = None
            for layer in self.layers:
                hidden_states = layer(hidden_states, past_key_values=past_key_values)
            return hidden_states
    """)


def test_a_cache_named_otherwise_is_renamed_where_it_is_used_and_handed_on(make_ctx):
    assert_codemod(rule, BEFORE, AFTER, make_ctx)


def test_what_is_not_a_cache_is_left_alone(make_ctx):
    # a dict's update takes one argument; a function already holding past_key_values keeps its own names
    assert_noop(
        rule, BEFORE.replace("kv_cache.update(k, v, self.layer_number)", "kv_cache.update(k)"), make_ctx
    )
    held = BEFORE.replace(
        "def forward(self, hidden_states, kv_cache=None):\n        return",
        "def forward(self, hidden_states, kv_cache=None, past_key_values=None):\n        return",
    )
    assert "kv_cache=None, past_key_values" in held
    out = run_codemod(rule, held, make_ctx())
    assert "kv_cache" in out and "past_key_values.update" not in out  # its callers' keyword must match


def test_a_closure_reads_the_renamed_cache_and_a_name_another_function_takes_otherwise_stays(make_ctx):
    closure = BEFORE.replace(
        "        return self.self_attention(hidden_states, kv_cache=kv_cache)",
        "        def run(x):\n            return self.self_attention(x, kv_cache=kv_cache)\n\n        return run(hidden_states)",
    )
    out = run_codemod(rule, closure, make_ctx())
    assert "return self.self_attention(x, past_key_values=past_key_values)" in out and "kv_cache=" not in out
    flag = (
        BEFORE
        + "\n\nclass Other(nn.Module):\n    def forward(self, x, kv_cache: bool = False):\n        return x if kv_cache else -x\n"
    )
    assert run_codemod(rule, flag, make_ctx()) == flag  # renamed everywhere or nowhere
