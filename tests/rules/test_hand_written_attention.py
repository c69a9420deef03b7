"""hand_written_attention: attention written out by hand (q @ kᵀ, softmax, @ v, or a direct SDPA call) becomes
the canonical `heads_first_attention(self, q, k, v, ...)` call runtime_attention converts; the scores' path is
read for the scale, masks and a banded (sliding-window) causal buffer, and anything else is refused by name."""

from textwrap import dedent, indent

from codemod_harness import assert_codemod, assert_noop, run_codemod

from skills.migrator.rules.hand_written_attention import HandWrittenAttention as rule

HEADER = dedent("""\
    import math

    import torch
    import torch.nn.functional as F
    from torch import nn


    """)

INIT = dedent("""\
    class Attn(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.head_dim = config.hidden_size // config.num_attention_heads

    """)

ENTRY = dedent("""\


    class LlamaForCausalLM(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.attn = Attn(config)
    """)


def attention_class(forward: str) -> str:
    """A module of one attention class (its __init__ sets head_dim) with this forward, reached by the entry."""
    return HEADER + INIT + indent(dedent(forward), "    ") + ENTRY


# XGLM / TrOCR: bmm over [B*H, T, D], the query scaled before, a shape check, the mask, dropout, weights returned.
INLINE = """\
class Attn(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.scaling = self.head_dim**-0.5

    def forward(self, hidden_states, attention_mask=None):
        bsz, tgt_len, _ = hidden_states.size()
        query_states = (self.q_proj(hidden_states) * self.scaling).view(bsz * self.num_heads, tgt_len, -1)
        key_states = self.k_proj(hidden_states).view(bsz * self.num_heads, tgt_len, -1)
        value_states = self.v_proj(hidden_states).view(bsz * self.num_heads, tgt_len, -1)
%s
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        return self.out_proj(attn_output.reshape(bsz, tgt_len, -1)), attn_weights
"""
INLINE_SCORES = """\
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if attn_weights.size() != (bsz * self.num_heads, tgt_len, tgt_len):
            raise ValueError("wrong size")
        if attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, tgt_len) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, tgt_len)
        attn_weights = attn_weights.masked_fill(attention_mask == 0, -1e4)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_probs = nn.functional.dropout(attn_weights, p=0.1, training=self.training)
        attn_output = torch.bmm(attn_probs, value_states)"""
INLINE_CALL = """\
        attn_output, attn_weights = heads_first_attention(self, query_states, key_states, value_states, scaling=1.0)"""


def test_inline_bmm_attention_becomes_the_canonical_call(make_ctx):
    before = HEADER + INLINE % INLINE_SCORES + ENTRY
    assert_codemod(rule, before, HEADER + INLINE % INLINE_CALL + ENTRY, make_ctx)


# GPT-Neo: a helper method in fp32, a causal buffer made banded for "local" layers, no scale at all.
HELPER = (
    HEADER
    + dedent("""\
    class Attn(nn.Module):
        def __init__(self, config, attention_type):
            super().__init__()
            bias = torch.tril(torch.ones((8, 8), dtype=bool)).view(1, 1, 8, 8)
            if attention_type == "local":
                bias = torch.bitwise_xor(bias, torch.tril(bias, -config.window_size))
            self.bias = nn.Buffer(bias, persistent=False)
            self.head_dim = config.hidden_size // config.num_heads

        def _attn(self, query, key, value, attention_mask=None):
            query = query.to(torch.float32)
            attn_weights = torch.matmul(query, key.transpose(-1, -2))
            query_length, key_length = query.size(-2), key.size(-2)
            causal_mask = self.bias[:, :, key_length - query_length : key_length, :key_length]
            mask_value = torch.finfo(attn_weights.dtype).min
            attn_weights = torch.where(causal_mask, attn_weights, mask_value)
            if attention_mask is not None:
                attn_weights = attn_weights + attention_mask
            attn_weights = nn.functional.softmax(attn_weights, dim=-1).to(value.dtype)
            attn_output = torch.matmul(attn_weights, value)
            return attn_output, attn_weights

        def forward(self, hidden_states, attention_mask=None):
            query, key, value = self._split(hidden_states)
            attn_output, attn_weights = self._attn(query, key, value, attention_mask)
            return self.out_proj(attn_output), attn_weights
    """)
    + ENTRY
)


def test_a_helper_is_folded_into_its_call_site_with_the_banded_buffer_as_a_sliding_window(make_ctx):
    after = run_codemod(rule, HELPER, make_ctx())
    assert "def _attn" not in after
    init = after[after.index("def __init__") : after.index("def forward")]
    assert "bias" not in init and "self.head_dim = " in init  # the buffer and what only built it are gone
    window = 'sliding_window=config.window_size if attention_type == "local" else None'
    assert f"heads_first_attention(self, query, key, value, scaling=1.0, {window})" in after.replace(
        "\n", " "
    )
    assert run_codemod(rule, after, make_ctx()) == after


def test_a_dropped_buffer_the_checkpoint_holds_is_named_for_the_loader_to_skip(make_ctx):
    """minGPT registers its causal buffer persistently, so checkpoints hold `...attn.bias`: the class names it in
    `_skipped_checkpoint_buffers`, which the loader skips. GPT-Neo's `persistent=False` one is in no checkpoint."""
    persistent = HELPER.replace("nn.Buffer(bias, persistent=False)", "nn.Buffer(bias)")
    after = run_codemod(rule, persistent, make_ctx())
    declared = (
        "class Attn(nn.Module):\n"
        "    # the checkpoint's causal-mask buffers, which the runtime's attention replaces: loading skips them\n"
        '    _skipped_checkpoint_buffers = ("bias",)\n'
    )
    assert declared in after and "self.bias" not in after
    assert run_codemod(rule, after, make_ctx()) == after
    registered = persistent.replace("self.bias = nn.Buffer(bias)", 'self.register_buffer("bias", bias)')
    assert declared in run_codemod(rule, registered, make_ctx())
    assert "_skipped_checkpoint_buffers" not in run_codemod(rule, HELPER, make_ctx())


def test_products_written_as_einsum_are_read_as_the_matmuls_they_are(make_ctx):
    """`einsum("bhqd,bhkd->bhqk", q, k)` is q @ kᵀ and `einsum("bhqk,bhkd->bhqd", w, v)` is w @ v: the same
    canonical call as the matmul form; an einsum that is no such product (a sum over keys) is not a region."""
    scores = "torch.matmul(query, key.transpose(-1, -2))"
    einsum = HELPER.replace(scores, 'torch.einsum("bhqd,bhkd->bhqk", query, key)').replace(
        "torch.matmul(attn_weights, value)", 'torch.einsum("...qk,...kd->...qd", attn_weights, value)'
    )
    assert einsum != HELPER and scores in HELPER
    assert run_codemod(rule, einsum, make_ctx()) == run_codemod(rule, HELPER, make_ctx())
    summed = HELPER.replace(scores, 'torch.einsum("bhqd,bhkd->bhq", query, key)')
    assert "heads_first_attention" not in run_codemod(rule, summed, make_ctx())


def test_a_direct_sdpa_call_keeps_what_wraps_it(make_ctx):
    before = attention_class("""\
        def forward(self, query, key, value, attention_mask):
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=0.5).mT
            return self.dense(out.flatten(2))
        """)
    after = before.replace(
        "out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=0.5).mT",
        "out = heads_first_attention(self, query, key, value, scaling=0.5)\n        out = out.mT",
    )
    assert_codemod(rule, before, after, make_ctx)


BIASED = attention_class("""\
    def forward(self, query, key, value, position_bias, attention_mask):
        scores = query @ key.transpose(-1, -2)
        scores = (scores + position_bias) / math.sqrt(self.head_dim)
        probs = F.softmax(scores + attention_mask, dim=-1)
        attn_output = probs @ value
        return attn_output
    """)


def test_an_alibi_bias_joins_the_attention_scaled_as_the_scores_after_it(make_ctx):
    # MPT passes its ALiBi tensor as `position_bias=alibi`; Falcon scales scores and bias together.
    before = BIASED + "\n\nbias = block(hidden_states, position_bias=alibi)\n"
    scale = "1 / (math.sqrt(self.head_dim))"
    computation = before[before.index("        scores = query") : before.index("        return attn_output")]
    call = f"heads_first_attention(self, query, key, value, scaling={scale}, alibi={scale})"
    assert_codemod(rule, before, before.replace(computation, f"        attn_output = {call}\n"), make_ctx)


def test_another_bias_added_to_the_scores_is_refused_by_name(make_ctx):
    ctx = make_ctx()
    assert run_codemod(rule, BIASED, ctx) == BIASED
    assert [f.what for f in ctx.findings] == [
        "hand-written attention: `position_bias` added to the attention scores (a position bias other than ALiBi)"
    ]


def test_a_scale_read_at_run_time_is_refused(make_ctx):
    before = (
        HEADER
        + INLINE
        % INLINE_SCORES.replace(
            "attn_weights = nn.functional.softmax(attn_weights, dim=-1)",
            "if self.training:\n            attn_weights = attn_weights / 2\n"
            "        attn_weights = nn.functional.softmax(attn_weights, dim=-1)",
        )
        + ENTRY
    )
    ctx = make_ctx()
    run_codemod(rule, before, ctx)
    assert "scale chosen at run time" in ctx.findings[0].what


# GPT-1: a key kept transposed, a scale its constructor decides, the causal buffer, a helper returning a list.
GPT1 = (
    HEADER
    + dedent("""\
    class Attn(nn.Module):
        def __init__(self, config, scale=False):
            super().__init__()
            self.bias = nn.Buffer(torch.tril(torch.ones(8, 8)).view(1, 1, 8, 8), persistent=False)
            self.scale = scale

        def _attn(self, q, k, v, attention_mask=None):
            w = torch.matmul(q, k)
            if self.scale:
                w = w / math.sqrt(v.size(-1))
            b = self.bias[:, :, : w.size(-2), : w.size(-1)]
            w = w * b + -1e4 * (1 - b)
            w = nn.functional.softmax(w, dim=-1)
            outputs = [torch.matmul(w, v)]
            return outputs

        def forward(self, x):
            query, key, value = self.split(x)
            attn_outputs = self._attn(query, key, value, None)
            return self.c_proj(attn_outputs[0])
    """)
    + ENTRY
)


def test_a_scale_its_constructor_decides_and_a_wrapped_helper_output(make_ctx):
    ctx = make_ctx()
    after = run_codemod(rule, GPT1, ctx)
    assert ctx.findings == [] and "def _attn" not in after and "self.bias" not in after
    scaling = "scaling=(1 / (math.sqrt(attention_head_dim)) if self.scale else 1.0)"
    call = f"attn_outputs = heads_first_attention(self, query, key.transpose(-1, -2), value, {scaling})"
    assert f"{call}\n        attn_outputs = [attn_outputs]\n" in after
    assert run_codemod(rule, after, make_ctx()) == after


def test_interface_attention_and_plain_products_are_untouched(make_ctx):
    assert_noop(rule, HEADER + INLINE % INLINE_CALL + ENTRY, make_ctx)
    no_softmax = (
        HEADER
        + dedent("""\
        class Attn(nn.Module):
            def forward(self, x, w):
                return torch.matmul(x, w) @ w
        """)
        + ENTRY
    )
    assert_noop(rule, no_softmax, make_ctx)
    router = (
        HEADER
        + dedent("""\
        class Attn(nn.Module):
            def forward(self, hidden_states):
                router_logits = hidden_states @ self.weight.t()
                routing_weights = F.softmax(router_logits, dim=-1)
                return torch.topk(routing_weights, 2, dim=-1)
        """)
        + ENTRY
    )
    assert_noop(rule, router, make_ctx)


# Falcon: an implementation dispatch (the eager path is kept), and, for ALiBi checkpoints, a path of its own.
FALCON = attention_class("""\
    def forward(self, query, key, value, alibi):
        if alibi is None:
            query, key = self.rotary(query, key)
        if alibi is None:
            if self.config._attn_implementation == "sdpa" and not False:
                attn_output = F.scaled_dot_product_attention(query, key, value, attn_mask=None)
            else:
                attention_scores = query @ key.transpose(-1, -2)
                attention_scores /= math.sqrt(self.head_dim)
                attention_scores = F.softmax(attention_scores + None, dim=-1, dtype=query.dtype)
                attn_output = attention_scores @ value
            return self.dense(attn_output)
        else:
            scores = query @ key.transpose(-1, -2)
            attn_output = F.softmax(scores + alibi, dim=-1) @ value
            return self.dense(attn_output)
    """).replace(
    "self.attn = Attn(config)",
    "self.attn = Attn(config)\n        self.use_alibi = config.alibi\n\n"
    "    def forward(self, x):\n        alibi = None\n        if self.use_alibi:\n"
    "            alibi = build_alibi_tensor(x)\n        return self.attn(x, x, x, alibi)",
)


def test_the_eager_path_of_an_implementation_dispatch_is_kept(make_ctx):
    rotary_only = FALCON[: FALCON.index("        else:\n            scores")] + ENTRY
    ctx = make_ctx()
    after = run_codemod(rule, rotary_only, ctx)
    assert ctx.findings == [] and "_attn_implementation" not in after
    scaling = "scaling=1 / (math.sqrt(self.head_dim))"
    assert f"attn_output = heads_first_attention(self, query, key, value, {scaling})\n" in after


def test_two_paths_a_forward_picks_between_share_one_cache_and_alibi_is_asked_of_the_config(make_ctx):
    """Falcon: with ALiBi or without (rotary), on the one cache HF updates before the branch; `alibi is None`
    is asked of the config switch under which the model builds its ALiBi tensor."""
    ctx = make_ctx()
    after = run_codemod(rule, FALCON, ctx)
    assert ctx.findings == []
    rotary = (
        "attn_output = heads_first_attention(self, query, key, value, scaling=1 / (math.sqrt(self.head_dim)))"
    )
    alibi = "heads_first_attention(self, query, key, value, scaling=1.0, alibi=1.0, shares_cache=True)"
    assert rotary in after and alibi in after
    assert after.count("if not self.use_alibi:") == 2 and "alibi is None" not in after
    assert (
        "        self.head_dim = config.hidden_size // config.num_attention_heads\n        self.use_alibi = config.alibi\n"
        in after
    )
    assert run_codemod(rule, after, make_ctx()) == after


def test_two_computations_that_may_both_run_are_refused(make_ctx):
    both = attention_class("""\
        def forward(self, query, key, value):
            first = query @ key.transpose(-1, -2)
            a = F.softmax(first, dim=-1) @ value
            second = a @ key.transpose(-1, -2)
            b = F.softmax(second, dim=-1) @ value
            return a + b
        """)
    ctx = make_ctx()
    assert run_codemod(rule, both, ctx) == both
    assert len(ctx.findings) == 1 and "two attention computations in one forward that may both run" in (
        ctx.findings[0].what
    )


def test_alibi_chosen_per_call_without_a_config_switch_is_refused(make_ctx):
    per_call = FALCON.replace("        if self.use_alibi:\n", "        if x.shape[0] > 1:\n")
    ctx = make_ctx()
    assert run_codemod(rule, per_call, ctx) == per_call
    assert "ALiBi used or not per call (`alibi is None`), with no config switch found" in ctx.findings[0].what


# Qwen (remote code): the helper returns its last product, and scales by a 0-d tensor of the divisor.
RETURNED = (
    HEADER
    + dedent("""\
    class Attn(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.head_dim = config.hidden_size // config.num_heads

        def _attn(self, query, key, value):
            attn_weights = torch.matmul(query, key.transpose(-1, -2))
            attn_weights = attn_weights / torch.full([], value.size(-1) ** 0.5, dtype=attn_weights.dtype)
            attn_weights = nn.functional.softmax(attn_weights, dim=-1)
            return torch.matmul(attn_weights.type(value.dtype), value)

        def forward(self, hidden_states):
            query, key, value = self._split(hidden_states)
            attn_output = self._attn(query, key, value)
            return self.c_proj(attn_output)
    """)
    + ENTRY
)


def test_a_helper_returning_its_product_folds_and_a_0_d_tensor_scale_is_its_value(make_ctx):
    helper = RETURNED[RETURNED.index("    def _attn") : RETURNED.index("    def forward")]
    call = "attn_output = heads_first_attention(self, query, key, value, scaling=1 / (attention_head_dim ** 0.5))"
    after = RETURNED.replace(helper, "").replace("attn_output = self._attn(query, key, value)", call)
    assert_codemod(rule, RETURNED, after, make_ctx)


def test_a_helper_returning_a_direct_sdpa_call_is_left_whole_not_a_crash(make_ctx):
    sdpa = RETURNED.replace(
        "return torch.matmul(attn_weights.type(value.dtype), value)",
        "return F.scaled_dot_product_attention(query, key, value, is_causal=True)",
    )
    sdpa = sdpa.replace("            attn_weights = nn.functional.softmax(attn_weights, dim=-1)\n", "")
    run_codemod(rule, sdpa, make_ctx())  # left to MG005, which names what it cannot convert
