"""sparse_indexer: a sparse-attention indexer's key cache (`cache.update_indexer`) becomes the runtime's
IndexKeyCache, its forward runs in the per-request layout, and the attention hands its picks over as `indices=`
(MG005 makes them the runtime Attention's `selected=`) instead of scattering them into a mask."""

from textwrap import dedent

import pytest
from codemod_harness import assert_codemod, assert_noop

from skills.migrator.rules.sparse_indexer import SparseIndexer as rule

# DeepSeek-V3.2's indexer and attention as transformers writes them, shortened.
BEFORE = dedent("""\
    class Indexer(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.layer_idx = layer_idx
            self.head_dim: int = config.index_head_dim
            self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)

        def forward(self, hidden_states, q_resid, attention_mask, position_ids, cache=None):
            \"\"\"Top-k token indices per query.\"\"\"
            q = self.wq_b(q_resid)
            k = self.wk(hidden_states)
            if cache is not None:
                k = cache.update_indexer(k, self.layer_idx)
            scores = torch.matmul(q, k.transpose(-1, -2))
            if attention_mask.dtype == torch.bool:
                scores = scores.masked_fill(~attention_mask, float("-inf"))
            else:
                scores = scores + attention_mask
            return scores.topk(min(self.index_topk, scores.shape[-1]), dim=-1).indices


    class Attention(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.indexer = None if config.skip_topk else Indexer(config, layer_idx)

        def forward(self, hidden_states, attention_mask, position_ids=None, cache=None, **kwargs):
            q_resid = self.q_a_proj(hidden_states)
            topk_indices = self.indexer(hidden_states, q_resid, attention_mask[:, 0], position_ids, cache=cache)
            sparse_indices = None
            if self.config._attn_implementation in ("eager", "sdpa"):
                index_mask = torch.ones_like(attention_mask).scatter(-1, topk_indices.long(), False)
                attention_mask = attention_mask & ~index_mask
            else:
                sparse_indices = topk_indices
            return eager_attention_forward(self, q, k, v, attention_mask, indices=sparse_indices, **kwargs)
    """)

AFTER = dedent("""\
    from runtime.engine.forward_metadata import ForwardMetaData
    from runtime.layers.index_cache import IndexKeyCache, by_request

    class Indexer(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.layer_idx = layer_idx
            self.head_dim: int = config.index_head_dim
            self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
            self.index_cache = IndexKeyCache(self.head_dim)

        def forward(self, hidden_states, q_resid, attention_mask, position_ids, cache=None, *, forward_metadata: ForwardMetaData):
            \"\"\"Top-k token indices per query.\"\"\"
            hidden_states = by_request(hidden_states, forward_metadata)
            q_resid = by_request(q_resid, forward_metadata)
            q = self.wq_b(q_resid)
            k = self.wk(hidden_states)
            k, visible = self.index_cache(k, forward_metadata)
            scores = torch.matmul(q, k.transpose(-1, -2))
            scores = scores.masked_fill(~visible, float("-inf"))
            return scores.topk(min(self.index_topk, scores.shape[-1]), dim=-1).indices


    class Attention(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.indexer = None if config.skip_topk else Indexer(config, layer_idx)

        def forward(self, hidden_states, attention_mask, position_ids=None, cache=None, *, forward_metadata: ForwardMetaData, **kwargs):
            q_resid = self.q_a_proj(hidden_states)
            topk_indices = self.indexer(hidden_states, q_resid, attention_mask[:, 0], position_ids, cache=cache, forward_metadata=forward_metadata)
            sparse_indices = topk_indices
            return eager_attention_forward(self, q, k, v, attention_mask, indices=sparse_indices, **kwargs)
    """)


def test_the_indexer_caches_its_keys_in_the_runtime_and_hands_its_picks_over(make_ctx):
    assert_codemod(rule, BEFORE, AFTER, make_ctx)


def test_the_legacy_layout_builds_a_legacy_key_cache(run_rule):
    assert "IndexKeyCache(self.head_dim, legacy=True)" in run_rule(rule, BEFORE, kv_layout="legacy")


def test_a_file_without_an_indexer_is_left_alone(make_ctx):
    code = dedent("""\
        class Attention(nn.Module):
            def forward(self, hidden_states, attention_mask, cache=None):
                if cache is not None:
                    k, v = cache.update(k, v, self.layer_idx)
                if self.config._attn_implementation == "eager":
                    attention_mask = attention_mask.bool()
                else:
                    attention_mask = None
                return eager_attention_forward(self, q, k, v, attention_mask)
        """)
    assert_noop(rule, code, make_ctx)


MASK_READ = """\
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask
"""


@pytest.mark.parametrize(
    "change, why",
    [
        ((MASK_READ, ""), "masks its scores neither"),
        (("self.head_dim: int = config", "self.key_dim: int = config"), "no `self.head_dim`"),
        (
            (
                "    def forward(self, hidden_states, q_resid",
                "    def score(self, hidden_states, q_resid",
            ),
            "outside",
        ),
    ],
    ids=["scores_unmasked", "no_head_dim", "not_in_forward"],
)
def test_what_the_rule_cannot_follow_is_refused_by_name(run_rule, make_ctx, change, why):
    code = BEFORE.replace(*change)
    assert code != BEFORE
    ctx = make_ctx()
    assert run_rule(rule, code, ctx) == code
    assert len(ctx.findings) == 1 and why in ctx.findings[0].what


def test_only_the_branch_handing_the_picks_over_is_folded(run_rule):
    """Dots3 runs its indexer on some layers only: the picks stay None elsewhere, so that `None` is kept; another
    branch on the implementation, binding no name passed as `indices=`, stays as it is."""
    code = BEFORE.replace(
        """        q_resid = self.q_a_proj(hidden_states)
        topk_indices = self.indexer(hidden_states, q_resid, attention_mask[:, 0], position_ids, cache=cache)
        sparse_indices = None
        if self.config._attn_implementation in ("eager", "sdpa"):
            index_mask = torch.ones_like(attention_mask).scatter(-1, topk_indices.long(), False)
            attention_mask = attention_mask & ~index_mask
        else:
            sparse_indices = topk_indices
""",
        """        q_resid = self.q_a_proj(hidden_states)
        sparse_indices = None
        if self.indexer is not None:
            topk_indices = self.indexer(hidden_states, q_resid, attention_mask[:, 0], position_ids, cache=cache)
            if self.config._attn_implementation in ("eager", "sdpa"):
                index_mask = torch.ones_like(attention_mask).scatter(-1, topk_indices.long(), False)
                attention_mask = attention_mask & ~index_mask
            else:
                sparse_indices = topk_indices
        if self.config._attn_implementation == "eager":
            scale = 1.0
        else:
            scale = 2.0
""",
    )
    out = run_rule(rule, code)
    assert (
        """        sparse_indices = None
        if self.indexer is not None:
            topk_indices = self.indexer(hidden_states, q_resid, attention_mask[:, 0], position_ids, cache=cache, forward_metadata=forward_metadata)
            sparse_indices = topk_indices
        if self.config._attn_implementation == "eager":
            scale = 1.0
        else:
            scale = 2.0
"""
        in out
    )


@pytest.mark.parametrize(
    "read",
    ["scores = scores + self.attention_mask.sum()", "scores = f(scores, attention_mask=attention_mask)"],
    ids=["attribute_of_that_name", "keyword"],
)
def test_a_mask_read_other_than_masking_the_scores_is_refused(run_rule, make_ctx, read):
    code = BEFORE.replace("        return scores.topk(", f"        {read}\n        return scores.topk(")
    ctx = make_ctx()
    assert run_rule(rule, code, ctx) == code
    assert len(ctx.findings) == 1 and "masks its scores neither" in ctx.findings[0].what


def test_the_function_calling_the_indexer_takes_forward_metadata_not_one_defined_inside_it(run_rule):
    code = BEFORE.replace(
        "        sparse_indices = None\n",
        "        sparse_indices = None\n\n        def scaled(x):\n            return x * 2\n\n",
    )
    out = run_rule(rule, code)
    assert "def scaled(x):" in out
    assert "cache=None, *, forward_metadata: ForwardMetaData, **kwargs):" in out


# MiniMax-M3's indexer and attention as transformers writes them, shortened: keys of one head written heads first in
# the cache layer (`update_index`), the future masked by position, blocks of keys picked per key head, the mask
# built from them only on the eager path (no else arm: the picks go to the kernel as `block_indices=`).
BLOCKS_BEFORE = dedent("""\
    class Indexer(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.layer_idx = layer_idx
            self.head_dim = config.index_head_dim
            self.block_size = config.index_block_size
            self.k_proj = nn.Linear(config.hidden_size, self.head_dim, bias=False)

        def forward(self, hidden_states, cache, position_ids):
            q = self.q_proj(hidden_states).view(*hidden_states.shape[:2], -1, self.head_dim).transpose(1, 2)
            k = self.k_proj(hidden_states)[:, None]
            if cache is not None:
                k = cache.layers[self.layer_idx].update_index(k)
            scores = torch.matmul(q, k.transpose(-1, -2))
            future = torch.arange(k.shape[2])[None, None, None, :] > position_ids[:, None, :, None]
            scores = scores.masked_fill(future, float("-inf"))
            blocks = scores.view(*scores.shape[:-1], -1, self.block_size).amax(-1)
            return blocks.topk(2, dim=-1).indices

        def build_block_mask(self, block_indices, key_length):
            keep = torch.zeros(*block_indices.shape[:-1], key_length, dtype=torch.bool)
            keep = keep.scatter(-1, block_indices, True)
            return keep.repeat_interleave(self.block_size, dim=-1)[..., :key_length]


    class Attention(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.indexer = Indexer(config, layer_idx) if config.layer_types[layer_idx] == "sparse" else None

        def forward(self, hidden_states, attention_mask, cache=None, **kwargs):
            block_indices = None
            if self.indexer is not None:
                position_ids = kwargs["position_ids"]
                block_indices = self.indexer(hidden_states, cache, position_ids)
                if self.config._attn_implementation in ("eager", "sdpa"):
                    attention_mask = self.indexer.build_block_mask(block_indices, k.shape[2])
            return eager_attention_forward(self, q, k, v, attention_mask, block_indices=block_indices, **kwargs)
    """)

BLOCKS_AFTER = dedent("""\
    from runtime.engine.forward_metadata import ForwardMetaData
    from runtime.layers.index_cache import IndexKeyCache, by_request

    class Indexer(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.layer_idx = layer_idx
            self.head_dim = config.index_head_dim
            self.block_size = config.index_block_size
            self.k_proj = nn.Linear(config.hidden_size, self.head_dim, bias=False)
            self.index_cache = IndexKeyCache(self.head_dim)

        def forward(self, hidden_states, cache, position_ids, *, forward_metadata: ForwardMetaData):
            hidden_states = by_request(hidden_states, forward_metadata)
            position_ids = by_request(position_ids, forward_metadata)
            q = self.q_proj(hidden_states).view(*hidden_states.shape[:2], -1, self.head_dim).transpose(1, 2)
            k = self.k_proj(hidden_states)[:, None]
            k, _ = self.index_cache(k, forward_metadata)
            scores = torch.matmul(q, k.transpose(-1, -2))
            future = torch.arange(k.shape[2])[None, None, None, :] > position_ids[:, None, :, None]
            scores = scores.masked_fill(future, float("-inf"))
            blocks = scores.view(*scores.shape[:-1], -1, self.block_size).amax(-1)
            return blocks.topk(2, dim=-1).indices

        def build_block_mask(self, block_indices, key_length):
            keep = torch.zeros(*block_indices.shape[:-1], key_length, dtype=torch.bool)
            keep = keep.scatter(-1, block_indices, True)
            return keep.repeat_interleave(self.block_size, dim=-1)[..., :key_length]


    class Attention(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.indexer = Indexer(config, layer_idx) if config.layer_types[layer_idx] == "sparse" else None

        def forward(self, hidden_states, attention_mask, cache=None, *, forward_metadata: ForwardMetaData, **kwargs):
            block_indices = None
            if self.indexer is not None:
                position_ids = kwargs["position_ids"]
                block_indices = self.indexer(hidden_states, cache, position_ids, forward_metadata=forward_metadata)
            return eager_attention_forward(self, q, k, v, attention_mask, indices=block_indices, index_block=config.index_block_size, **kwargs)
    """)


def test_an_indexer_masking_by_position_hands_its_block_picks_over_with_their_size(make_ctx):
    """Its positions go per request with its other inputs; the eager arm building the mask goes; the picks pass as
    `indices=`, the size of their blocks (what the mask builder expands them by) as `index_block=`."""
    assert_codemod(rule, BLOCKS_BEFORE, BLOCKS_AFTER, make_ctx)


@pytest.mark.parametrize(
    "change, why",
    [
        (
            ('        scores = scores.masked_fill(future, float("-inf"))\n', ""),
            "masks its scores neither",
        ),
        (  # a condition that reads the positions but is no comparison with them
            ("scores.masked_fill(future,", "scores.masked_fill(position_ids.bool()[:, None, :, None],"),
            "masks its scores neither",
        ),
        (
            ("self.block_size = config.index_block_size", "self.block_size = block_size"),
            "does not set once from the config",
        ),
        (  # the indexer built with another config than the holder's
            ("Indexer(config, layer_idx) if", "Indexer(config.indexer, layer_idx) if"),
            "does not set once from the config its holder builds it with",
        ),
        (  # a mask the rule cannot read: blocks expanded along another axis
            ("repeat_interleave(self.block_size, dim=-1)", "repeat_interleave(self.block_size, dim=2)"),
            "passed as `block_indices=`, with a mask the rule cannot read",
        ),
    ],
    ids=["scores_unmasked", "no_comparison", "block_size_not_from_config", "other_config", "unread_mask"],
)
def test_what_the_rule_cannot_follow_in_block_picks_is_refused_by_name(run_rule, make_ctx, change, why):
    code = BLOCKS_BEFORE.replace(*change)
    assert code != BLOCKS_BEFORE
    ctx = make_ctx()
    out = run_rule(rule, code, ctx)
    assert len(ctx.findings) == 1 and why in ctx.findings[0].what
    assert " indices=" not in out
