"""Attention that mixes each token's own stack of states (Inkling2's block attention residual: learned queries
over the outputs of earlier blocks, per token, through the attention interface) becomes the runtime's
`stack_attention` over that stack (transformers' eager attention, which MG021 does not take for a sequence's):

    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
    attn_output, _ = attention_interface(self, query_states, stacked_states, stacked_states, None, scaling=s)
->
    attn_output = stack_attention(query_states, stacked_states, stacked_states, s).transpose(1, 2)

A module is such when it is not causal (`self.is_causal = False`), takes no cache, and calls the interface with no
mask (`None`) and no argument but `scaling=`: nothing about it reads across tokens, which the runtime's attention
would take it to. It runs before MG005, which would otherwise build a runtime Attention (and a KV cache) for it."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import (
    assigned_names,
    code,
    findall,
    method,
    param_names,
    rewrite_classes,
    with_method,
)
from skills.migrator.rule import Rule
from skills.migrator.rules.fold_hf_only_params import CACHES
from skills.migrator.rules.runtime_attention import interface_call

NOT_CAUSAL = m.Assign([m.AssignTarget(m.Attribute(m.Name("self"), m.Name("is_causal")))], m.Name("False"))
PAIR = m.Assign([m.AssignTarget(m.Tuple([m.Element(m.Name()), m.Element(m.Name("_"))]))])


def _plain(call: cst.Call) -> str | None:
    """`stack_attention(q, k, v, s).transpose(1, 2)` (the eager interface's layout) for `interface(self, q, k, v,
    None, scaling=s)`; None for any other call."""
    given = [a for a in call.args if a.keyword is None]
    named = {a.keyword.value: a for a in call.args if a.keyword is not None}
    if len(given) != 5 or any(a.star for a in call.args) or set(named) != {"scaling"}:
        return None
    if not m.matches(given[4].value, m.Name("None")):
        return None
    q, k, v = (code(a.value) for a in given[1:4])
    return f"stack_attention({q}, {k}, {v}, {code(named['scaling'].value)}).transpose(1, 2)"


def _rewrite(cls: cst.ClassDef) -> cst.ClassDef | None:
    init, fwd = method(cls, "__init__"), method(cls, "forward")
    if init is None or fwd is None or not findall(init, NOT_CAUSAL) or set(param_names(fwd)) & CACHES:
        return None
    line = next((s for s in fwd.body.body if interface_call(s)), None)
    if line is None or not m.matches(line, m.SimpleStatementLine([PAIR])):
        return None
    call = interface_call(line)
    if (plain := _plain(call)) is None:
        return None
    out = line.body[0].targets[0].target.elements[0].value
    new_line = line.with_changes(body=[cst.parse_statement(f"{out.value} = {plain}\n").body[0]])
    picked = call.func.value  # `attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(...)` goes
    body = [
        new_line if s is line else s for s in fwd.body.body if s is line or picked not in assigned_names(s)
    ]
    new_fwd = fwd.with_changes(body=fwd.body.with_changes(body=body))
    return with_method(cls, fwd, new_fwd)


class DepthAttention(Rule):
    ID = "MG040"
    DESCRIPTION = "Attention over each token's own stack of states becomes the runtime's stack_attention."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        out = rewrite_classes(module, _rewrite)
        if out is not module:
            self.add_needed_import("runtime.layers.attention", "stack_attention")
        return out
