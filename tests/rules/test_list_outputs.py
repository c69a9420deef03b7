"""list_outputs: outputs wrapped in a one-element list become the tensor, in the function and across the calls
this file shows; a list read otherwise, or a module called where the file does not show, stays."""

from textwrap import dedent

from codemod_harness import assert_codemod, assert_noop

from skills.migrator.rules.list_outputs import ListOutputs as rule

# GPT-1 after MG004 folded output_attentions away.
BEFORE = dedent("""\
    class Attention(nn.Module):
        def forward(self, x, *, forward_metadata):
            attn_outputs = self.attn(x, forward_metadata)
            attn_outputs = [attn_outputs]
            a = attn_outputs[0]
            a = self.c_proj(a)
            outputs = [a] + attn_outputs[1:]
            return outputs


    class Block(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.attn = Attention(config)

        def forward(self, x, **kwargs):
            attn_outputs = self.attn(x, **kwargs)
            a = attn_outputs[0]
            h = self.ln(x + a)
            outputs = [h] + attn_outputs[1:]
            return outputs


    class Model(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.h = nn.ModuleList([Block(config) for _ in range(2)])

        def forward(self, hidden_states, **kwargs):
            for block in self.h:
                outputs = block(hidden_states, **kwargs)
                hidden_states = outputs[0]
            return hidden_states
    """)

AFTER = dedent("""\
    class Attention(nn.Module):
        def forward(self, x, *, forward_metadata):
            attn_outputs = self.attn(x, forward_metadata)
            a = attn_outputs
            a = self.c_proj(a)
            outputs = a
            return outputs


    class Block(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.attn = Attention(config)

        def forward(self, x, **kwargs):
            attn_outputs = self.attn(x, **kwargs)
            a = attn_outputs
            h = self.ln(x + a)
            outputs = h
            return outputs


    class Model(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.h = nn.ModuleList([Block(config) for _ in range(2)])

        def forward(self, hidden_states, **kwargs):
            for block in self.h:
                outputs = block(hidden_states, **kwargs)
                hidden_states = outputs
            return hidden_states
    """)


def test_one_element_lists_become_their_element(make_ctx):
    assert_codemod(rule, BEFORE, AFTER, make_ctx)


def test_a_list_a_caller_reads_whole_stays_a_list(run_rule):
    code = BEFORE.replace("outputs = [h] + attn_outputs[1:]", "outputs = [h] + attn_outputs")
    out = run_rule(rule, code)
    assert "outputs = [a]\n" in out  # its own [0] / [1:] reads unwrapped, the list it returns kept
    assert "outputs = [h] + attn_outputs\n" in out and "hidden_states = outputs[0]" in out


def test_a_module_whose_calls_the_file_does_not_show_keeps_its_list(run_rule):
    out = run_rule(rule, BEFORE + "\n\nisinstance(x, Block)\n")  # the class escapes
    assert "outputs = h\n" not in out and "outputs = [h]\n" in out and "hidden_states = outputs[0]" in out
    assert "a = attn_outputs\n" in out  # the attention's calls are all in Block: its list goes


def test_other_lists_stay(make_ctx):
    code = dedent("""\
        class Block(nn.Module):
            def forward(self, x):
                pair = [x, x]
                first = [x]
                y = first[0] + pair[0]
                return first, y
        """)
    assert_noop(rule, code, make_ctx)
