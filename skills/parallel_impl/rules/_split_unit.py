"""A tensor-parallel unit split over two sibling modules, as BERT builds its attention (SelfAttention, then
SelfOutput holding the output projection) and its MLP (Intermediate, then Output): a method of their parent
hands what the opening module returns straight to the closing one, whose forward first applies its one linear
to it and then only combines the result with its other arguments (`LayerNorm(x + input_tensor)`).

The opener enters the unit's TPRegion and returns its rank's share (of the heads, or of the intermediate
columns); the closer's linear becomes a RowParallelLinear whose partial sums the closer's own TPRegion of the
same group sums right after it."""

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import (
    SELF_ASSIGN_CALL,
    called_name,
    classes,
    free_names,
    method,
    param_names,
    read_names,
)
from skills.parallel_impl.rules._units import (
    LINEAR,
    Layer,
    bound_call,
    edit_body,
    exit_point,
    exit_region,
    is_docstring,
    linear_args,
    local_values,
    parallel_layer,
    plumbed,
    region,
    replace_methods,
    self_layers,
    self_refs,
)


@dataclass(frozen=True)
class Closer:
    """The closing half: class `cls`, whose one linear `linear` forward's statement `exit_at` applies first."""

    cls: cst.ClassDef
    linear: Layer
    exit_at: int


def built_classes(init: cst.FunctionDef) -> dict[str, str]:
    """attr -> the callee of each top-level `self.<attr> = Callee(...)` of init, through a local bound once to a
    name (BERT's `attention_class = BertSelfAttention`)."""
    aliases = local_values(init)
    found = {}
    for s in init.body.body:
        if m.matches(s, SELF_ASSIGN_CALL):
            callee = called_name(s.body[0].value)
            alias = aliases.get(callee)
            found[s.body[0].targets[0].target.attr.value] = (
                alias.value if isinstance(alias, cst.Name) else callee
            )
    return found


def _handed_to(body: Sequence[cst.BaseStatement], attr: str) -> str | None:
    """b, when `n = self.<attr>(...)` is followed by `... = self.<b>(n, ...)` (or `return self.<b>(n, ...)`), the
    next statement reading n, which reads it nowhere else, and nothing reads n after it unless it rebinds n."""
    if (bound := bound_call(body, attr)) is None:
        return None
    at, name = bound
    readers = [j for j in range(at + 1, len(body)) if name in read_names(body[j])]
    call = m.Call(m.Attribute(m.Name("self"), m.Name()))
    if not readers or not m.matches(
        body[readers[0]], m.SimpleStatementLine([m.Assign(value=call) | m.Return(call)])
    ):
        return None
    assign = body[readers[0]].body[0]
    call = assign.value
    first, rest = (call.args[0], call.args[1:]) if call.args else (None, ())
    if first is None or first.keyword or first.star or not m.matches(first.value, m.Name(name)):
        return None
    if any(name in free_names(a.value) for a in rest):
        return None
    rebound = isinstance(assign, cst.Assign) and any(
        m.matches(t.target, m.Name(name)) for t in assign.targets
    )
    return call.func.attr.value if rebound or len(readers) == 1 else None


def applied_first(fwd: cst.FunctionDef, attr: str) -> bool:
    """forward's first statement is `name = self.<attr>(<its first argument>)`."""
    params = param_names(fwd)
    body = [s for s in fwd.body.body if not is_docstring(s)]
    if len(params) < 2 or not body:
        return False
    call = m.Call(m.Attribute(m.Name("self"), m.Name(attr)), [m.Arg(m.Name(params[1]), keyword=None)])
    return m.matches(body[0], m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name())], call)]))


def _closer(cls: cst.ClassDef) -> Closer | None:
    """cls as a closing half: one linear, which forward applies first, to its first argument, and whose partial
    sums can be summed right there (exit_point)."""
    init, fwd = method(cls, "__init__"), method(cls, "forward")
    if init is None or fwd is None or not plumbed(init):
        return None
    linears = self_layers(init, LINEAR)
    if len(linears) != 1:
        return None
    (layer,) = linears.values()
    if not applied_first(fwd, layer.attr) or linear_args(layer.call) is None:
        return None
    at = exit_point(fwd, layer.attr)
    return None if at is None else Closer(cls, layer, at)


def closing_half(module: cst.Module, opener: str) -> Closer | None:
    """The closing half of the unit that class `opener` opens: its one owner builds it once and one method hands
    its output to a module of a class that module builds once (see _handed_to and _closer)."""
    local = classes(module)
    owners, counts = [], Counter()
    for owner in local.values():
        if (init := method(owner, "__init__")) is None:
            continue
        built = built_classes(init)
        counts.update(built.values())
        owners += [(owner, attr, built) for attr, callee in built.items() if callee == opener]
    if len(owners) != 1 or self_refs(owners[0][0], owners[0][1]) != 2:
        return None
    owner, attr, built = owners[0]
    fns = [f for f in owner.body.body if isinstance(f, cst.FunctionDef)]
    handed = [
        b for f in fns if isinstance(f.body, cst.IndentedBlock) and (b := _handed_to(f.body.body, attr))
    ]
    if len(handed) != 1 or self_refs(owner, handed[0]) != 2:
        return None
    closing = built.get(handed[0])
    return _closer(local[closing]) if closing in local and counts[closing] == 1 else None


def closed(closer: Closer, group: str, whole_sequence: bool = False) -> cst.ClassDef:
    """The closing class with its linear a RowParallelLinear of group, whose partial sums its TPRegion sums right
    after it."""
    init, fwd = method(closer.cls, "__init__"), method(closer.cls, "forward")
    layer = closer.linear
    row = [*linear_args(layer.call).layer_args(), "reduce_results=False"]
    new_init = edit_body(
        init,
        {id(layer.line): [parallel_layer(layer.attr, "RowParallelLinear", row, group, layer.line)]},
        [region(group, whole_sequence)],
    )
    return replace_methods(closer.cls, {"__init__": new_init, "forward": exit_region(fwd, closer.exit_at)})
