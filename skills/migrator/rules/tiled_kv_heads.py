"""Keys and values tiled across the query heads (`k = k.repeat(1, n, 1, 1)` before `self.attn(q, k, v, md)`,
as JetMoE does: query head h reads kv head h % kv_heads) are cached once: both repeats go and the layer gets
`Attention(..., kv_heads_tiled=True)`, which maps the query heads onto the cached ones the same way.

Only a pair of repeats of the keys and the values the attention call reads, with the same count and only the
head dimension (1 of HF's [batch, heads, tokens, head_dim]) repeated, is rewritten."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import (
    attention_layer,
    code,
    kwarg,
    method,
    rewrite_classes,
    with_attention_kwarg,
)
from skills.migrator.rule import Rule

ONE = m.Arg(m.Integer("1"), keyword=None)


def _tile(line: cst.BaseStatement, name: str) -> str | None:
    """The repeat count of a top-level `name = name.repeat(1, n, 1, 1)`, else None."""
    pattern = m.SimpleStatementLine(
        [
            m.Assign(
                [m.AssignTarget(m.Name(name))],
                m.Call(
                    func=m.Attribute(m.Name(name), m.Name("repeat")),
                    args=[ONE, m.Arg(keyword=None), ONE, ONE],
                ),
            )
        ]
    )
    return code(line.body[0].value.args[1].value) if m.matches(line, pattern) else None


def _rewrite(cls: cst.ClassDef) -> cst.ClassDef | None:
    init, fwd = method(cls, "__init__"), method(cls, "forward")
    layer = attention_layer(init) if init is not None and fwd is not None else None
    if layer is None or any(kwarg(layer[1].body[0].value, k) for k in ("kv_heads_tiled", "latent_dim")):
        return None
    attr, attn_line = layer
    calls = m.findall(fwd, m.Call(func=m.Attribute(m.Name("self"), m.Name(attr)), args=[m.Arg()] * 4))
    if len(calls) != 1 or not all(isinstance(a.value, cst.Name) for a in calls[0].args[1:3]):
        return None
    k, v = (a.value.value for a in calls[0].args[1:3])
    repeats = {name: [s for s in fwd.body.body if _tile(s, name)] for name in (k, v)}
    if k == v or any(len(r) != 1 for r in repeats.values()):
        return None
    if _tile(repeats[k][0], k) != _tile(repeats[v][0], v):
        return None
    doomed = {id(r[0]) for r in repeats.values()}
    new_fwd = fwd.with_changes(
        body=fwd.body.with_changes(body=[s for s in fwd.body.body if id(s) not in doomed])
    )
    return with_attention_kwarg(cls, attn_line, "kv_heads_tiled", "True", fwd, new_fwd)


class TiledKVHeads(Rule):
    ID = "MG020"
    DESCRIPTION = "Keys and values tiled over the query heads with .repeat are cached once (kv_heads_tiled)."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        return rewrite_classes(module, _rewrite)
