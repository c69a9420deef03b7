"""A tensor-parallel unit split over two sibling modules, as BERT builds its attention (SelfAttention, then
SelfOutput holding the output projection) and its MLP (Intermediate, then Output): a method of their parent
hands what the opening module returns straight to the closing one, whose forward first applies its one linear
to it and then only combines the result with its other arguments (`LayerNorm(x + input_tensor)`).

The opener enters the unit's TPRegion and returns its rank's share (of the heads, or of the intermediate
columns); the closer's linear becomes a RowParallelLinear whose partial sums the closer's own TPRegion of the
same group sums right after it."""

from collections.abc import Sequence
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import (
    SELF_ASSIGN_CALL,
    assigned_names,
    called_name,
    classes,
    findall,
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
    """The closing half of a unit: class `cls`, whose forward applies its one linear `linear` first, in its
    statement number `exit_at`."""

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


def named_once(module: cst.Module, name: str) -> bool:
    """The module names class `name` once besides its definition: one place builds it (directly or through one
    alias), none builds it in a list, under a branch, or subclasses it."""
    return len(findall(module, m.Name(name))) == 2


def _handed_to(body: Sequence[cst.BaseStatement], attr: str) -> str | None:
    """b, when `n = self.<attr>(...)` is followed by `... = self.<b>(n, ...)` (or `return self.<b>(n, ...)`), the
    next statement reading n, which reads it nowhere else; nothing between rebinds n, and nothing after reads it
    unless that statement rebinds it."""
    if (bound := bound_call(body, attr)) is None:
        return None
    at, name = bound
    readers = [j for j in range(at + 1, len(body)) if name in read_names(body[j])]
    call = m.Call(m.Attribute(m.Name("self"), m.Name()))
    if not readers or not m.matches(
        body[readers[0]], m.SimpleStatementLine([m.Assign(value=call) | m.Return(call)])
    ):
        return None
    if any(name in assigned_names(s) for s in body[at + 1 : readers[0]]):
        return None
    handed = body[readers[0]].body[0]
    call = handed.value
    first, rest = (call.args[0], call.args[1:]) if call.args else (None, ())
    if first is None or first.keyword or first.star or not m.matches(first.value, m.Name(name)):
        return None
    if any(name in free_names(a.value) for a in rest):
        return None
    rebound = isinstance(handed, cst.Assign) and any(
        m.matches(t.target, m.Name(name)) for t in handed.targets
    )
    return call.func.attr.value if rebound or len(readers) == 1 else None


def applied_first(cls: cst.ClassDef) -> Layer | None:
    """The one linear of cls (plain nn.Linear arguments, used by forward alone) when forward's first statement is
    `name = self.<linear>(<its first argument>)`."""
    init, fwd = method(cls, "__init__"), method(cls, "forward")
    linears = self_layers(init, LINEAR) if init is not None else {}
    if fwd is None or len(linears) != 1 or not plumbed(init):
        return None
    (layer,) = linears.values()
    params = param_names(fwd)
    body = [s for s in fwd.body.body if not is_docstring(s)]
    if len(params) < 2 or not body or self_refs(cls, layer.attr) != 2 or linear_args(layer.call) is None:
        return None
    call = m.Call(m.Attribute(m.Name("self"), m.Name(layer.attr)), [m.Arg(m.Name(params[1]), keyword=None)])
    first = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name())], call)])
    return layer if m.matches(body[0], first) else None


def _closer(cls: cst.ClassDef) -> Closer | None:
    """cls as a closing half: its linear applied first (applied_first), whose partial sums can be summed right
    there (exit_point)."""
    if (layer := applied_first(cls)) is None:
        return None
    at = exit_point(method(cls, "forward"), layer.attr)
    return None if at is None else Closer(cls, layer, at)


def closing_half(module: cst.Module, opener: str) -> Closer | None:
    """The closing half of the unit that class `opener` opens: one class of module builds the opener, once, and
    one of its methods hands the opener's output to a module of a class built once too (see _handed_to and
    _closer)."""
    local = classes(module)
    built = {name: built_classes(init) for name, c in local.items() if (init := method(c, "__init__"))}
    owners = [(local[o], attr, b) for o, b in built.items() for attr, callee in b.items() if callee == opener]
    if len(owners) != 1 or not named_once(module, opener) or self_refs(owners[0][0], owners[0][1]) != 2:
        return None
    owner, attr, siblings = owners[0]
    fns = [f for f in owner.body.body if isinstance(f, cst.FunctionDef)]
    handed = [
        b for f in fns if isinstance(f.body, cst.IndentedBlock) and (b := _handed_to(f.body.body, attr))
    ]
    if len(handed) != 1 or self_refs(owner, handed[0]) != 2:
        return None
    closing = siblings.get(handed[0])
    return _closer(local[closing]) if closing in local and named_once(module, closing) else None


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
