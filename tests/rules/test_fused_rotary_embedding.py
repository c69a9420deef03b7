"""fused_rotary_embedding: apply_rotary_pos_emb written out returns the runtime's rotary_embedding."""

from textwrap import dedent

import pytest
from codemod_harness import assert_codemod, assert_noop

from skills.migrator.rules.fused_rotary_embedding import FusedRotaryEmbedding as rule

ROTATE_HALF = dedent('''\
    def rotate_half(x):
        """Rotates half the hidden dims of the input."""
        x1 = x[..., : x.shape[-1] // 2]
        x2 = x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)
    ''')

# transformers' llama, its docstring shortened
BEFORE = (
    "import torch\n\n\n"
    + ROTATE_HALF
    + dedent('''\


    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        """Applies Rotary Position Embedding to the query and key tensors."""
        cos = cos.unsqueeze(unsqueeze_dim)
        sin = sin.unsqueeze(unsqueeze_dim)
        q_embed = (q * cos) + (rotate_half(q) * sin)
        k_embed = (k * cos) + (rotate_half(k) * sin)
        return q_embed, k_embed
    ''')
)

AFTER = (
    "import torch\nfrom runtime.layers.rotary import rotary_embedding\n\n\n"
    + ROTATE_HALF
    + dedent('''\


    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        """Applies Rotary Position Embedding to the query and key tensors."""
        return rotary_embedding(q, k, cos, sin, unsqueeze_dim)
    ''')
)


def test_apply_rotary_pos_emb_becomes_one_call(make_ctx):
    """rotate_half stays for other rules to judge (MG010 drops it once nothing calls it)."""
    assert_codemod(rule, BEFORE, AFTER, make_ctx)


def test_other_names_and_no_docstrings(make_ctx):
    rename = {
        "rotate_half": "rot",
        "x1": "lo",
        "x2": "hi",
        "q_embed": "qo",
        "k_embed": "ko",
        "unsqueeze_dim": "d",
    }
    before, after = BEFORE, AFTER
    for old, new in rename.items():
        before, after = before.replace(old, new), after.replace(old, new)
    for docstring in (
        '    """Rotates half the hidden dims of the input."""\n',
        '    """Applies Rotary Position Embedding to the query and key tensors."""\n',
    ):
        before, after = before.replace(docstring, ""), after.replace(docstring, "")
    assert_codemod(rule, before, after, make_ctx)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        # interleaved pairs (GPT-J style rotation)
        (
            "x1 = x[..., : x.shape[-1] // 2]\n    x2 = x[..., x.shape[-1] // 2 :]",
            "x1 = x[..., 0::2]\n    x2 = x[..., 1::2]",
        ),
        # the outputs cast back, a sign flipped, the key left out, q and k swapped
        ("return q_embed, k_embed", "return q_embed.to(q.dtype), k_embed.to(k.dtype)"),
        ("(rotate_half(q) * sin)", "-(rotate_half(q) * sin)"),
        ("k_embed = (k * cos) + (rotate_half(k) * sin)", "k_embed = k"),
        ("return q_embed, k_embed", "return k_embed, q_embed"),
        # a rotation that is not this file's half split, cos unsqueezed elsewhere, a parameter more
        ("(rotate_half(q) * sin)", "(torch.flip(q, (-1,)) * sin)"),
        ("cos = cos.unsqueeze(unsqueeze_dim)", "cos = cos.unsqueeze(2)"),
        ("unsqueeze_dim=1):", "unsqueeze_dim=1, position_ids=None):"),
        # names bound twice: the rotation's low half in its input's name, the query's output in cos's
        (
            "x1 = x[..., : x.shape[-1] // 2]\n    x2 = x[..., x.shape[-1] // 2 :]\n    return torch.cat((-x2, x1)",
            "x = x[..., : x.shape[-1] // 2]\n    x2 = x[..., x.shape[-1] // 2 :]\n    return torch.cat((-x2, x)",
        ),
        (
            (
                "q_embed = (q * cos) + (rotate_half(q) * sin)\n    k_embed = (k * cos) + (rotate_half(k) * sin)\n"
                "    return q_embed,"
            ),
            (
                "cos = (q * cos) + (rotate_half(q) * sin)\n    k_embed = (k * cos) + (rotate_half(k) * sin)\n"
                "    return cos,"
            ),
        ),
        # rotate_half bound again after its definition
        ("\n\ndef apply_rotary_pos_emb", "\n\nrotate_half = torch.flip\n\n\ndef apply_rotary_pos_emb"),
    ],
    ids=[
        "interleaved",
        "cast",
        "sign",
        "no-key",
        "swapped",
        "other-rotation",
        "other-axis",
        "extra-parameter",
        "aliased-half",
        "aliased-output",
        "rebound-rotation",
    ],
)
def test_anything_else_is_left_as_it_is(make_ctx, old, new):
    assert old in BEFORE
    assert_noop(rule, BEFORE.replace(old, new), make_ctx)


def test_a_file_without_rotary_embeddings_is_unchanged(make_ctx):
    assert_noop(rule, ROTATE_HALF, make_ctx)
