"""Submodules nothing calls go: GPT-2 builds a cross-attention block and its norm when
`config.add_cross_attention` is set, which a causal LM never runs once the encoder's states are folded away
(MG004). A checkpoint may still hold their weights, so the entry's `load_named_weights` skips the tensors under
those attribute names (`ignored=`), as transformers leaves them unused; a module that holds none (a rotary
embedding's buffers) needs no pattern, nor one built only in a branch that MG025 folds away once the others are
gone (GPT-2's `q_attn`, built when `is_cross_attention`). Only names that no module in use shares go, and only
where the entry loads through `load_named_weights`."""

from collections.abc import Collection

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import (
    SELF_ASSIGN_CALL,
    SELF_ATTR,
    Transformer,
    called_name,
    classes,
    code,
    findall,
    method,
)
from skills.migrator.rule import Rule
from skills.migrator.rules.constructor_defaults import fold_defaults
from skills.migrator.rules.dead_code import DropStatements, unused_attrs

LOAD = m.Call(m.Name("load_named_weights"))


def _builds_module(call: cst.Call, local: set[str]) -> bool:
    """A constructor call: an in-file class, or a CapWords class such as `nn.LayerNorm` or `Conv1D` (not a
    tensor: `nn.Parameter`, `nn.Buffer`, which DeadCode weighs)."""
    name = called_name(call)
    leaf = name.split(".")[-1]
    return name in local or (leaf[:1].isupper() and leaf not in ("Parameter", "Buffer"))


def _may_hold_weights(
    call: cst.Call, local: dict[str, cst.ClassDef], seen: frozenset[str] = frozenset()
) -> bool:
    """Whether the module call builds can hold checkpoint tensors: a layer from outside the file, or an in-file
    class whose __init__ builds one or a parameter (a rotary embedding's buffers are not in the checkpoint)."""
    name = called_name(call)
    if name not in local:
        return True
    init = method(local[name], "__init__")
    calls = findall(init, m.Call()) if init is not None and name not in seen else []
    return any(
        called_name(c).split(".")[-1] == "Parameter"
        or (_builds_module(c, set(local)) and _may_hold_weights(c, local, seen | {name}))
        for c in calls
    )


def _unread_modules(module: cst.Module, entry: str) -> tuple[set[str], set[str]]:
    """The x of `self.x = <module>(...)` statements (anywhere in an __init__) that nothing reads, where every
    assignment of a `self.x` in the file is such a statement and no string names x (but the checkpoint prefix the
    plumbing gives it, `join_prefix(prefix, "x")`); and those of them that may hold checkpoint tensors."""
    local, unused = classes(module), unused_attrs(module, entry)
    prefixes = {
        id(s) for c in findall(module, m.Call(m.Name("join_prefix"))) for s in findall(c, m.SimpleString())
    }
    named = {
        s.raw_value for s in findall(module, m.SimpleString()) if id(s) not in prefixes
    }  # getattr(self, "x")
    writes: dict[str, int] = {}
    doomed: dict[str, int] = {}
    weighted: set[str] = set()
    for name, cls in local.items():
        for target in findall(cls, m.AssignTarget(SELF_ATTR)):
            writes[target.target.attr.value] = writes.get(target.target.attr.value, 0) + 1
        init = method(cls, "__init__")
        for s in findall(init, SELF_ASSIGN_CALL) if init is not None else ():
            attr = s.body[0].targets[0].target.attr.value
            if attr in unused.get(name, set()) and _builds_module(s.body[0].value, set(local)):
                doomed[attr] = doomed.get(attr, 0) + 1
                if _may_hold_weights(s.body[0].value, local):
                    weighted.add(attr)
    gone = {attr for attr, n in doomed.items() if writes[attr] == n and attr not in named}
    return gone, gone & weighted


class _Ignore(Transformer):
    """`load_named_weights(..., ignored=[...])` with patterns added."""

    def __init__(self, patterns: list[str]):
        self.patterns = patterns

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if not m.matches(updated, LOAD):
            return updated
        given = next((a for a in updated.args if a.keyword and a.keyword.value == "ignored"), None)
        old = [code(e.value) for e in given.value.elements] if given else []
        value = cst.parse_expression(f"[{', '.join([*old, *self.patterns])}]")
        if given is None:
            return updated.with_changes(
                args=[*updated.args, cst.Arg(value, keyword=cst.Name("ignored"), equal=_EQUAL)]
            )
        return updated.with_changes(
            args=[a.with_changes(value=value) if a is given else a for a in updated.args]
        )


_EQUAL = cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace(""))


def _without(module: cst.Module, attrs: Collection[str]) -> cst.Module:
    """module without the `self.x = <call>` statements of attrs."""
    return module.visit(
        DropStatements(
            lambda s: m.matches(s, SELF_ASSIGN_CALL) and s.body[0].targets[0].target.attr.value in attrs
        )
    )


def _built(module: cst.Module, attr: str) -> bool:
    return bool(findall(module, m.AssignTarget(m.Attribute(m.Name("self"), m.Name(attr)))))


class UnreadModules(Rule):
    ID = "MG024"
    DESCRIPTION = "Submodules nothing calls go (cross-attention); the loader skips their checkpoint tensors."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        entry = classes(module).get(self.rewrite.entry_class)
        loads = findall(entry, LOAD) if entry is not None else []
        doomed, weighted = _unread_modules(module, self.rewrite.entry_class) if len(loads) == 1 else ((), ())
        if not doomed:
            return module
        # a module built only in a branch that goes once the others do needs no pattern (GPT-2's `q_attn`, built
        # when `is_cross_attention`, which MG025 folds to False once the cross-attention block is gone)
        on_disk = [
            a for a in sorted(weighted) if _built(fold_defaults(_without(module, set(doomed) - {a})), a)
        ]
        module = _without(module, doomed)
        patterns = [f'r"(^|\\.){attr}\\."' for attr in on_disk]
        if not patterns:
            return module
        return module.with_changes(
            body=[
                s.visit(_Ignore(patterns))
                if m.matches(s, m.ClassDef(m.Name(self.rewrite.entry_class)))
                else s
                for s in module.body
            ]
        )
