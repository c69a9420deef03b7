"""A relative position bias handed to the attention interface (`position_bias=`, which HF's eager attention adds
to the scaled scores) becomes the runtime `Attention`'s `distance_bias=`:

    position_bias = self.rel_logits_proj(relative_states, q_positions, kv_positions)
    out, w = attention_interface(self, q, k, v, attention_mask, position_bias=position_bias)
->
    position_bias = self.rel_logits_proj(relative_states, *distance_positions(forward_metadata))
    out, w = attention_interface(self, q, k, v, attention_mask, distance_bias=position_bias)

HF materialises the bias densely over every query and key position. The runtime takes it per query token, head and
backward distance instead (column d for the key d positions back), and the module computes exactly that table
when every query sits at D - 1 and key d at D - 1 - d (`distance_positions`). That holds for a module whose forward
reads the two positions only as their difference (`query_positions[:, None] - key_positions[None, :]`: Inkling's
`InklingRelativeLogits`), so only such a module is converted. What forward does to the bias afterwards stays: a
factor per query (Inkling's log scaling, `[..., queries, 1]`) scales a table row as it scaled the dense one.
Anything else passed as `position_bias=` is left to MG005, which refuses it by name."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.call_sites import binding, instance_attrs, named_params
from skills.migrator.cst_utils import (
    assigned_names,
    classes,
    code,
    findall,
    free_names,
    method,
    rewrite_classes,
    with_forward_metadata,
)
from skills.migrator.rule import Rule
from skills.migrator.rules.runtime_attention import named_argument

SELF_CALL = m.Call(func=m.Attribute(m.Name("self"), m.Name()))


def _reads_only_the_difference(fwd: cst.FunctionDef, queries: str, keys: str) -> bool:
    """fwd reads its queries' and keys' positions once each, as one `<queries ...> - <keys ...>`."""
    if len(findall(fwd.body, m.Name(queries))) != 1 or len(findall(fwd.body, m.Name(keys))) != 1:
        return False
    return any(
        free_names(d.left) - {"None"} == {queries} and free_names(d.right) - {"None"} == {keys}
        for d in findall(fwd.body, m.BinaryOperation(operator=m.Subtract()))
    )


def _states(call: cst.Call, cls: cst.ClassDef) -> cst.BaseExpression | None:
    """What call passes the bias module's forward as its states, if that forward takes (states, query positions,
    key positions), all passed, and reads the two positions only as their difference; None for any other module."""
    fwd = method(cls, "forward")
    params = named_params(fwd)[1:] if fwd else []
    if len(params) != 3 or any(binding(call, fwd, p) is None for p in params):
        return None
    queries, keys = (p.name.value for p in params[1:])
    return binding(call, fwd, params[0]).value if _reads_only_the_difference(fwd, queries, keys) else None


def _rewrite(cls: cst.ClassDef, local: dict[str, cst.ClassDef]) -> cst.ClassDef | None:
    if (found := named_argument(cls, "position_bias")) is None:
        return None
    fwd, line, call, arg = found
    made = [s for s in fwd.body.body[: fwd.body.body.index(line)] if arg.value.value in assigned_names(s)]
    value = (
        made[0].body[0].value if made and m.matches(made[0], m.SimpleStatementLine([m.Assign()])) else None
    )
    if not m.matches(value, SELF_CALL):
        return None
    init = method(cls, "__init__")
    built = instance_attrs(init, set(local)).get(value.func.attr.value) if init else None
    states = _states(value, local[built[0]]) if built and not built[1] else None
    if states is None:
        return None
    table = cst.parse_expression(
        f"self.{value.func.attr.value}({code(states)}, *distance_positions(forward_metadata))"
    )
    new_call = call.deep_replace(arg, arg.with_changes(keyword=cst.Name("distance_bias")))
    new = {id(made[0]): made[0].deep_replace(value, table), id(line): line.deep_replace(call, new_call)}
    body = [new.get(id(s), s) for s in fwd.body.body]
    new_fwd = with_forward_metadata(fwd.with_changes(body=fwd.body.with_changes(body=body)))
    return cls.with_changes(
        body=cls.body.with_changes(body=[new_fwd if s is fwd else s for s in cls.body.body])
    )


class DistanceBias(Rule):
    ID = "MG038"
    DESCRIPTION = (
        "A relative position bias passed as position_bias= becomes the runtime Attention's distance_bias=."
    )

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        local = classes(module)
        out = rewrite_classes(module, lambda cls: _rewrite(cls, local))
        if out is not module:
            self.add_needed_imports(
                [
                    ("runtime.layers.attention", "distance_positions"),
                    ("runtime.engine.forward_metadata", "ForwardMetaData"),
                ]
            )
        return out
