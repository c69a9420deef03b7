"""Multi-head latent attention caches its latents, not per-head keys and values: where forward builds both from
per-token latents (`k, v = self.expand_kv(kv_latent, k_rot)`) only to hand them to the runtime `Attention`
(`self.attn(q, k, v, forward_metadata)`), the call becomes `self.attn.forward_latent(q, (kv_latent, k_rot),
self.expand_kv, forward_metadata)` and the layer gets `latent_dim=config.kv_lora_rank + config.qk_rope_head_dim`:
its cache holds those widths per token (one row), and it expands keys and values from the cached latents.

The width comes from the config names every MLA config uses; a class whose `__init__` reads neither is left
expanded, as is any forward that uses the keys or values otherwise."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import (
    assigned_names,
    attention_layer,
    code,
    findall,
    free_names,
    kwarg,
    method,
    param_names,
    rewrite_classes,
    with_attention_kwarg,
)
from skills.migrator.rule import Rule

LATENT_WIDTH = "config.kv_lora_rank + config.qk_rope_head_dim"
LATENT_KWARGS = ("cache_key", "selected")  # what forward_latent takes besides the layer call's four arguments
_SELF_CALL = m.Call(func=m.Attribute(m.Name("self"), m.Name()))
_PAIR = m.SimpleStatementLine(
    [m.Assign([m.AssignTarget(m.Tuple([m.Element(m.Name()), m.Element(m.Name())]))], _SELF_CALL)]
)


def _latent_call(
    fwd: cst.FunctionDef, attn: str
) -> tuple[cst.SimpleStatementLine, cst.Call, cst.Call] | None:
    """(the `k, v = self.<m>(latents...)` line, that call, the `self.<attn>(q, k, v, md)` call) when k and v are
    read only there and the latents are not rebound in between."""
    body = list(fwd.body.body)
    for i, line in enumerate(body):
        if not m.matches(line, _PAIR):
            continue
        expand = line.body[0].value
        k, v = (e.value.value for e in line.body[0].targets[0].target.elements)
        if not expand.args or any(a.keyword or a.star for a in expand.args):
            continue
        uses = m.Call(
            func=m.Attribute(m.Name("self"), m.Name(attn)),
            args=[
                m.Arg(keyword=None),
                m.Arg(m.Name(k), keyword=None),
                m.Arg(m.Name(v), keyword=None),
                m.Arg(keyword=None),
                m.ZeroOrMore(m.Arg(keyword=m.OneOf(*map(m.Name, LATENT_KWARGS)))),
            ],
        )
        for j in range(i + 1, len(body)):
            calls = findall(body[j], uses)
            if not calls:
                continue
            read = len(findall(fwd, m.Name(k))) + len(findall(fwd, m.Name(v)))
            latents = set().union(*(free_names(a.value) for a in expand.args))
            rebound = any(assigned_names(s) & latents for s in body[i + 1 : j])
            return (line, expand, calls[0]) if len(calls) == 1 and read == 4 and not rebound else None
    return None


def _rewrite(cls: cst.ClassDef) -> cst.ClassDef | None:
    init, fwd = method(cls, "__init__"), method(cls, "forward")
    if init is None or fwd is None or "config" not in param_names(init):
        return None
    if not all(f"config.{n}" in code(init) for n in ("kv_lora_rank", "qk_rope_head_dim")):
        return None
    layer = attention_layer(init)
    if layer is None or kwarg(layer[1].body[0].value, "latent_dim") is not None:
        return None
    attr, attn_line = layer
    found = _latent_call(fwd, attr)
    if found is None:
        return None
    pair, expand, call = found
    q, _, _, md = (code(a.value) for a in call.args[:4])
    latents = ", ".join(code(a.value) for a in expand.args) + ("," if len(expand.args) == 1 else "")
    keywords = "".join(f", {a.keyword.value}={code(a.value)}" for a in call.args[4:])
    new_call = cst.parse_expression(
        f"self.{attr}.forward_latent({q}, ({latents}), {code(expand.func)}, {md}{keywords})"
    )
    kept = fwd.with_changes(body=fwd.body.with_changes(body=[s for s in fwd.body.body if s is not pair]))
    return with_attention_kwarg(
        cls, attn_line, "latent_dim", LATENT_WIDTH, fwd, kept.deep_replace(call, new_call)
    )


class LatentKVCache(Rule):
    ID = "MG019"
    DESCRIPTION = "MLA attention caches its latents: keys and values are expanded from them (forward_latent)."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        return rewrite_classes(module, _rewrite)
