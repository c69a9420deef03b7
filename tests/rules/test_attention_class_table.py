"""attention_class_table: `X_ATTENTION_CLASSES[implementation](...)` becomes the table's eager class, and the
table goes once nothing reads it."""

from textwrap import dedent

from codemod_harness import assert_codemod, assert_noop, run_codemod

from skills.migrator.rules.attention_class_table import AttentionClassTable as rule

CLASSES = dedent("""\
    class FalconAttention(nn.Module):
        pass


    class FalconFlashAttention2(FalconAttention):
        pass


    """)

# Falcon (transformers 5.24): the decoder layer looks its attention class up by implementation.
BEFORE = CLASSES + dedent("""\
    FALCON_ATTENTION_CLASSES = {
        "eager": FalconAttention,
        "sdpa": FalconAttention,
        "flash_attention_2": FalconFlashAttention2,
    }


    class FalconDecoderLayer(nn.Module):
        def __init__(self, config, layer_idx=None):
            super().__init__()
            attn_implementation = config._attn_implementation
            self.self_attention = FALCON_ATTENTION_CLASSES[attn_implementation](config, layer_idx)
    """)

AFTER = CLASSES + dedent("""\
    class FalconDecoderLayer(nn.Module):
        def __init__(self, config, layer_idx=None):
            super().__init__()
            attn_implementation = config._attn_implementation
            self.self_attention = FalconAttention(config, layer_idx)
    """)


def test_the_eager_class_is_built_and_the_table_removed(make_ctx):
    assert_codemod(rule, BEFORE, AFTER, make_ctx)


def test_a_table_still_read_elsewhere_stays(make_ctx):
    before = BEFORE + "\n\nIMPLEMENTATIONS = list(FALCON_ATTENTION_CLASSES)\n"
    after = run_codemod(rule, before, make_ctx())
    assert "FALCON_ATTENTION_CLASSES = {" in after
    assert "self.self_attention = FalconAttention(config, layer_idx)" in after


def test_tables_without_an_eager_entry_are_untouched(make_ctx):
    assert_noop(rule, BEFORE.replace('"eager": FalconAttention,\n', ""), make_ctx)
