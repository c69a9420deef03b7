"""A relative position bias handed to the attention interface (`position_bias=`, which HF's eager attention adds
to the scaled scores) becomes the runtime `Attention`'s `distance_bias=`:

    position_bias = self.rel_logits_proj(relative_states, q_positions, kv_positions)
    out, w = attention_interface(self, q, k, v, attention_mask, position_bias=position_bias)
->
    position_bias = self.rel_logits_proj(relative_states, *distance_positions(forward_metadata))
    out, w = attention_interface(self, q, k, v, attention_mask, distance_bias=position_bias)

HF materialises the bias densely over every query and key position. The runtime takes it per query token, head and
backward distance instead (column d for the key d positions back), and the model's own bias module computes exactly
that table when every query sits at D - 1 and key d at D - 1 - d (`distance_positions`). That holds for a module
whose forward reads the two positions only as their difference (`query_positions[:, None] -
key_positions[None, :]`: Inkling's `InklingRelativeLogits`). A module given the distances themselves, which it
reads only to gather its table at them (`distances.clamp(...)`, `distances < 0`, `distances >= extent`: Inkling2's),
is converted where the file computes them as query minus key positions (a function returning `q[:, None] -
k[None, :]`): its calls give the runtime's `distance_columns(forward_metadata)` instead, whose column d holds d.
What forward does to the bias afterwards stays: a factor per query (Inkling's log scaling, `[..., queries, 1]`)
scales a row of the table as it scaled the dense bias. Anything else passed as `position_bias=` is left to MG005,
which refuses it by name."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.call_sites import binding, instance_attrs, named_params
from skills.migrator.cst_utils import (
    Transformer,
    assigned_names,
    classes,
    code,
    findall,
    free_names,
    method,
    rewrite_classes,
    with_forward_metadata,
    with_method,
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


def _gathers_by(fwd: cst.FunctionDef, distances: str) -> bool:
    """fwd reads its distances only to index a table by them: `distances.clamp(...)` and `distances < 0`,
    `distances >= extent` (Inkling2's bias gathers its table at the distances the model computed)."""
    reads = len(findall(fwd.body, m.Name(distances)))
    clamped = m.Call(func=m.Attribute(m.Name(distances), m.Name("clamp")))
    compared = m.Comparison(m.Name(distances), [m.ComparisonTarget(m.LessThan() | m.GreaterThanEqual())])
    return reads > 0 and reads == len(findall(fwd.body, clamped)) + len(findall(fwd.body, compared))


def _table_call(call: cst.Call, cls: cst.ClassDef, distances: bool) -> cst.Call | None:
    """call of the bias module evaluated where it yields the table by distance, if its forward takes (states,
    query positions, key positions) and reads the positions only as their difference; call itself if it is given
    distances and only gathers by them, and the file computes distances as query minus key positions
    (`distances`: MG038 gives those calls the runtime's); None for any other module."""
    fwd = method(cls, "forward")
    params = named_params(fwd)[1:] if fwd else []
    bound = [binding(call, fwd, p) for p in params]
    if (
        len(params) == 3
        and None not in bound
        and _reads_only_the_difference(fwd, *(p.name.value for p in params[1:]))
    ):
        table = f"{code(call.func)}({code(bound[0].value)}, *distance_positions(forward_metadata))"
        return cst.parse_expression(table)
    given = [
        a for p, a in zip(params, bound, strict=True) if a is not None and _gathers_by(fwd, p.name.value)
    ]
    return call if distances and len(given) == 1 else None


def _rewrite(
    cls: cst.ClassDef, local: dict[str, cst.ClassDef], distances: bool, gathering: list[str]
) -> cst.ClassDef | None:
    """cls handing its bias over as distance_bias=; a class whose bias module gathers by the model's distances is
    added to gathering."""
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
    table = _table_call(value, local[built[0]], distances) if built and not built[1] else None
    if table is None:
        return None
    if table is value:
        gathering.append(cls.name.value)
    new_call = call.deep_replace(arg, arg.with_changes(keyword=cst.Name("distance_bias")))
    new = {id(made[0]): made[0].deep_replace(value, table), id(line): line.deep_replace(call, new_call)}
    body = [new.get(id(s), s) for s in fwd.body.body]
    new_fwd = with_forward_metadata(fwd.with_changes(body=fwd.body.with_changes(body=body)))
    return with_method(cls, fwd, new_fwd)


def _distance_functions(module: cst.Module) -> set[str]:
    """Functions of the file returning distances as query minus key positions (`q[:, None] - k[None, :]`,
    Inkling2's `get_relative_distance`), by name."""
    difference = m.Return(m.BinaryOperation(m.Subscript(m.Name()), m.Subtract(), m.Subscript(m.Name())))
    return {
        fn.name.value
        for fn in findall(module, m.FunctionDef())
        if fn.body.body and m.matches(fn.body.body[-1], m.SimpleStatementLine([difference]))
    }


class _RuntimeDistances(Transformer):
    """Calls of the distance functions give the runtime's `distance_columns(forward_metadata)` instead, and the
    functions making them take forward_metadata."""

    def __init__(self, names: set[str]):
        self.names = names
        self.calls: list[bool] = []  # per enclosing function: whether it calls one

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.calls.append(False)

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        return with_forward_metadata(updated) if self.calls.pop() else updated

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        name = updated.func.value if isinstance(updated.func, cst.Name) else None
        if name not in self.names or not self.calls:
            return updated
        self.calls[-1] = True
        return cst.parse_expression("distance_columns(forward_metadata)")


class DistanceBias(Rule):
    ID = "MG038"
    DESCRIPTION = (
        "A relative position bias passed as position_bias= becomes the runtime Attention's distance_bias=."
    )

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        local, computed, gathering = classes(module), _distance_functions(module), []
        out = rewrite_classes(module, lambda cls: _rewrite(cls, local, bool(computed), gathering))
        if out is not module:
            out = out.visit(_RuntimeDistances(computed)) if gathering else out
            helpers = {
                c.func.value
                for c in findall(out, m.Call(m.Name("distance_positions") | m.Name("distance_columns")))
            }
            self.add_needed_imports(
                [("runtime.layers.attention", h) for h in sorted(helpers)]
                + [("runtime.engine.forward_metadata", "ForwardMetaData")]
            )
        return out
