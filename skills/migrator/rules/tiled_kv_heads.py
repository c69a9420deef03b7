"""Keys and values repeated over the query heads before the attention call are cached once, unrepeated:
- tiled (`k = k.repeat(1, n, 1, 1)`, as JetMoE does: query head h reads kv head h % kv_heads): both repeats go
  and the layer gets `Attention(..., kv_heads_tiled=True)`, which maps the query heads onto the cached ones the
  same way;
- grouped (`k = repeat_kv(k, n)`, transformers' helper that remote code copies, `k.repeat_interleave(n, dim=1)`, or
  repeat_kv's own steps inline, `k = k[:, :, None].expand(b, kv_heads, n, t, d)` then `k = k.reshape(b, heads, t,
  d)`: query head h reads kv head h // n, the runtime's own grouping): both repeats go.

Only a pair of repeats of the keys and the values the attention call reads, of one kind with the same count and
only the head dimension (1 of HF's [batch, heads, tokens, head_dim]) repeated, is rewritten."""

from functools import partial

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import (
    attention_layer,
    code,
    findall,
    kwarg,
    method,
    rewrite_classes,
    with_attention_kwarg,
)
from skills.migrator.rule import Rule

ONE = m.Arg(m.Integer("1"), keyword=None)
HEAD_DIM = m.Arg(m.Integer("1"), keyword=m.Name("dim") | None)


def _repeat(line: cst.BaseStatement, name: str) -> tuple[str, str] | None:
    """("tiled" or "grouped", the count) of a top-level `name = <name repeated over the heads>`, else None."""
    x, n = m.Arg(m.Name(name), keyword=None), m.Arg(keyword=None) | m.Arg(keyword=m.Name("repeats"))
    forms = [  # (kind, call, index of the count among its arguments)
        (
            "tiled",
            m.Call(m.Attribute(m.Name(name), m.Name("repeat")), [ONE, m.Arg(keyword=None), ONE, ONE]),
            1,
        ),
        ("grouped", m.Call(m.Name("repeat_kv"), [x, m.Arg(keyword=None)]), 1),
        ("grouped", m.Call(m.Attribute(m.Name(name), m.Name("repeat_interleave")), [n, HEAD_DIM]), 0),
        ("grouped", m.Call(m.Attribute(m.Name("torch"), m.Name("repeat_interleave")), [x, n, HEAD_DIM]), 1),
    ]
    if not m.matches(line, m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name(name))])])):
        return None
    value = line.body[0].value
    return next(
        ((kind, code(value.args[i].value)) for kind, call, i in forms if m.matches(value, call)), None
    )


def _full(e: cst.SubscriptElement) -> bool:
    return isinstance(e.slice, cst.Slice) and e.slice.lower is None and e.slice.upper is None


def _expand(value: cst.BaseExpression, name: str) -> str | None:
    """The count of `name[:, :, None].expand(b, kv_heads, n, t, d)` (a new axis after the heads, n copies each),
    else None."""
    if (
        not m.matches(value, m.Call(m.Attribute(m.Subscript(m.Name(name)), m.Name("expand"))))
        or len(value.args) != 5
    ):
        return None
    axes = value.func.value.slice
    added = len(axes) >= 3 and m.matches(axes[2].slice, m.Index(m.Name("None")))
    return (
        code(value.args[2].value) if added and all(_full(a) for i, a in enumerate(axes) if i != 2) else None
    )


MERGED = m.Call(m.Attribute(attr=m.Name("reshape") | m.Name("view"))) | m.Call(
    m.Attribute(attr=m.Name("flatten")), [m.Arg(m.Integer("1")), m.Arg(m.Integer("2"))]
)


def _expanded(body: list[cst.BaseStatement], name: str) -> tuple[str, list[cst.BaseStatement]] | None:
    """(the count, the lines) of keys repeated per head inline, as transformers' repeat_kv does it: `name =
    name[:, :, None].expand(...)` then `name = name.reshape(...)` (or `.view`, `.flatten(1, 2)`), in one statement
    or two."""
    assigns = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name(name))])])
    merges = m.SimpleStatementLine(
        [m.Assign([m.AssignTarget(m.Name(name))], m.Call(m.Attribute(m.Name(name))))]
    )
    for i, line in enumerate(body):
        if not m.matches(line, assigns):
            continue
        value = line.body[0].value
        if m.matches(value, MERGED) and (n := _expand(value.func.value, name)) is not None:
            return n, [line]
        after = body[i + 1] if i + 1 < len(body) else None
        n = _expand(value, name)
        if n is not None and m.matches(after, merges) and m.matches(after.body[0].value, MERGED):
            return n, [line, after]
    return None


def _repeated(body: list[cst.BaseStatement], name: str) -> tuple[str, str, list[cst.BaseStatement]] | None:
    """(kind, count, the lines) of the one repeat of `name` over the heads in body: a line of `_repeat`'s forms,
    else repeat_kv's steps inline (grouped)."""
    lines = [s for s in body if _repeat(s, name)]
    if len(lines) == 1:
        return (*_repeat(lines[0], name), lines)
    inline = _expanded(body, name) if not lines else None
    return ("grouped", *inline) if inline else None


def _grouping_repeat_kv(module: cst.Module) -> bool:
    """The file's own `repeat_kv`, if it has one, repeats each head in place as transformers' does (`expand` or
    `repeat_interleave`), not the whole run of heads (`.repeat`), which would be tiling."""
    own = [f for f in module.body if m.matches(f, m.FunctionDef(m.Name("repeat_kv")))]
    interleaves = m.Call(func=m.Attribute(attr=m.Name("expand") | m.Name("repeat_interleave")))
    return all(
        findall(f, interleaves) and not findall(f, m.Call(func=m.Attribute(attr=m.Name("repeat"))))
        for f in own
    )


def _rewrite(cls: cst.ClassDef, helper_groups: bool = True) -> cst.ClassDef | None:
    init, fwd = method(cls, "__init__"), method(cls, "forward")
    layer = attention_layer(init) if init is not None and fwd is not None else None
    if layer is None or any(kwarg(layer[1].body[0].value, k) for k in ("kv_heads_tiled", "latent_dim")):
        return None
    attr, attn_line = layer
    own = m.Attribute(m.Name("self"), m.Name(attr))
    calls = findall(
        fwd, m.Call(func=own | m.Attribute(own, m.Name("forward_heads_first")), args=[m.Arg()] * 4)
    )
    if len(calls) != 1 or not all(isinstance(a.value, cst.Name) for a in calls[0].args[1:3]):
        return None
    k, v = (a.value.value for a in calls[0].args[1:3])
    body = list(fwd.body.body)
    repeats = {name: _repeated(body, name) for name in (k, v)}
    if k == v or not all(repeats.values()) or repeats[k][:2] != repeats[v][:2]:
        return None
    kind = repeats[k][0]
    lines = [s for *_, found in repeats.values() for s in found]
    doomed = {id(s) for s in lines}
    new_fwd = fwd.with_changes(body=fwd.body.with_changes(body=[s for s in body if id(s) not in doomed]))
    if kind == "grouped":  # the layer must cache the unrepeated heads, as it is told
        helper = any(findall(s, m.Call(m.Name("repeat_kv"))) for s in lines)
        told = kwarg(layer[1].body[0].value, "num_kv_heads") is not None
        return cls.deep_replace(fwd, new_fwd) if told and (helper_groups or not helper) else None
    return with_attention_kwarg(cls, attn_line, "kv_heads_tiled", "True", fwd, new_fwd)


class TiledKVHeads(Rule):
    ID = "MG020"
    DESCRIPTION = (
        "Keys and values repeated over the query heads before attention are cached once, unrepeated."
    )

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        return rewrite_classes(module, partial(_rewrite, helper_groups=_grouping_repeat_kv(module)))
