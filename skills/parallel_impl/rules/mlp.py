"""Dense MLPs are sharded along the intermediate size in dense_tp_group: gate_proj + up_proj become one
MergedColumnParallelLinear `gate_up_proj` (a lone up projection a ColumnParallelLinear; one of output `2 * X` that
forward only halves with `.chunk(2, dim=-1)`, gate and up fused on disk, a MergedColumnParallelLinear whose
loader splits the tensor), the down projection a RowParallelLinear whose partial sums the class's TPRegion
reduces on the way out. An MLP split over two modules (BERT's Intermediate, then Output: see _split_unit) gets a
ColumnParallelLinear in the first and a RowParallelLinear summed right after it in the second.

A replicated MLP is still correct, so a class that doesn't match (MoE experts held as 3-D parameters, a router
named `gate`, extra arguments) is left as it is, without a finding."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import (
    SELF_ATTR,
    assigned_names,
    called_name,
    classes,
    doubled,
    findall,
    method,
)
from skills.migrator.rule import Rule
from skills.parallel_impl.rules._mlp_flow import flow_unit
from skills.parallel_impl.rules._split_unit import applied_first, closed, closing_half
from skills.parallel_impl.rules._units import (
    LINEAR,
    LINEAR_IMPORT,
    REGION_IMPORTS,
    Layer,
    LinearArgs,
    bound_call,
    code,
    edit_body,
    enter_region,
    exit_point,
    fuse_calls,
    has_region,
    is_docstring,
    linear_args,
    parallel_layer,
    plumbed,
    region,
    replace_classes,
    replace_methods,
    returns_output_of,
    self_layers,
    self_refs,
    wrap_region,
)

if TYPE_CHECKING:
    from skills.parallel_impl.rewrite import ParallelRewriteContext

GROUP = "dense_tp_group"
GATED = ("gate_proj", "up_proj")
COLUMN = ("fc1", "c_fc", "dense_h_to_4h", "up_proj", "gate_up_proj")
ROW = ("fc2", "c_proj", "dense_4h_to_h", "down_proj")
STACKED = [(".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]
_SPLITS = re.compile(r"\.(chunk|split|unbind|tensor_split)\(|\[\s*\.\.\.\s*,|\bswiglu\(")


def _unit(linears: dict[str, Layer]) -> tuple[tuple[str, ...], str] | None:
    """(column attrs, row attr) of the MLP these layers form; only they may be nn.Linear in the class."""
    rows = [a for a in ROW if a in linears]
    gated = "gate_proj" in linears
    columns = tuple(a for a in (GATED if gated else COLUMN) if a in linears)
    if len(rows) != 1 or len(columns) != (2 if gated else 1) or set(linears) != {*columns, *rows}:
        return None
    return columns, rows[0]


def _only_halved(fwd: cst.FunctionDef, attr: str) -> bool:
    """forward calls `self.<attr>` once and only halves its output along the last dimension, `.chunk(2, dim=-1)`
    or `torch.chunk(..., 2, dim=-1)`, on the call or on the name one top-level statement binds it to, which is
    not read again before it is rebound."""
    call = m.Call(func=m.Attribute(m.Name("self"), m.Name(attr)))
    minus_one = m.UnaryOperation(m.Minus(), m.Integer("1"))
    last = m.Arg(minus_one, keyword=m.Name("dim")) | m.Arg(minus_one, keyword=None)

    def halved(of: m.BaseMatcherNode) -> m.Call:
        method_form = m.Call(m.Attribute(of, m.Name("chunk")), [m.Arg(m.Integer("2")), last])
        return method_form | m.Call(
            m.Attribute(m.Name("torch"), m.Name("chunk")), [m.Arg(of), m.Arg(m.Integer("2")), last]
        )

    if self_refs(fwd, attr) != 1:
        return False
    if findall(fwd, halved(call)):
        return True
    body = list(fwd.body.body)
    if (bound := bound_call(body, attr)) is None:
        return False
    at, y = bound
    later = [s for s in body[at + 1 :] if findall(s, m.Name(y))]
    if not later or not m.matches(later[0], m.SimpleStatementLine([m.Assign(value=halved(m.Name(y)))])):
        return False
    for s in later:  # y's whole value is read only by the halving
        if s is not later[0] and len(findall(s, m.Name(y))) > len(findall(s, m.AssignTarget(m.Name(y)))):
            return False
        if y in assigned_names(s):
            return True
    return True


# calls that compute a size rather than build a module (Meta's `hidden_dim = int(2 * hidden_dim / 3)`)
ARITHMETIC = frozenset({"super", "int", "float", "round", "min", "max", "abs", "math.ceil", "math.floor"})


def _sized_by(init: cst.FunctionDef, skip: list[cst.BaseStatement], width: str) -> bool:
    """Another module of init is built with the intermediate width (BitNet's `ffn_sub_norm` between the
    projections), spelt as the projection spells it or as the value of the local it names: a rank would hand it
    only its share of that width."""
    spellings = [width] + [code(a.value) for a in findall(init, m.Assign([m.AssignTarget(m.Name(width))]))]
    pattern = re.compile("|".join(rf"(?<![\w.]){re.escape(w)}(?!\w)" for w in spellings))
    others = [s for s in init.body.body if not any(s is k for k in skip)]
    calls = [c for s in others for c in findall(s, m.Call()) if called_name(c) not in ARITHMETIC]
    return any(pattern.search(code(c)) for c in calls)


def _rewrite(cls: cst.ClassDef, ctx: ParallelRewriteContext, used: set[str]) -> cst.ClassDef | None:
    """The sharded class (the layer classes it uses added to `used`), None to leave it replicated."""
    init, fwd = method(cls, "__init__"), method(cls, "forward")
    linears = self_layers(init, LINEAR)
    if fwd is None or not plumbed(init):
        return None
    named = _unit(linears)
    unit = named or flow_unit(init, fwd, linears)  # found by its names, else by what forward does
    if unit is None:
        return None
    columns, row = unit
    args: dict[str, LinearArgs | None] = {a: linear_args(linears[a].call) for a in (*columns, row)}
    adds_after = not returns_output_of(fwd, row)  # BLOOM / MPT add the residual they are given
    if None in args.values():
        return None
    first, down = args[columns[0]], args[row]
    half = doubled(cst.parse_expression(first.out_features))  # X of an output `2 * X`
    width = code(half) if half is not None else first.out_features
    if _sized_by(init, [linears[a].line for a in (*columns, row)], width):
        return None
    if named is None:  # each column split along its outputs as it is, the row summed
        if len({args[a].out_features for a in columns}) != 1 or _SPLITS.search(code(fwd.body)):
            return None
        attr, ctor, out = columns[0], "ColumnParallelLinear", first.out_features
    elif len(columns) == 2:
        up = args["up_proj"]
        if (first.in_features, first.bias, first.transposed) != (
            up.in_features,
            up.bias,
            up.transposed,
        ) or any(self_refs(cls, a) != 2 for a in GATED):
            return None
        fwd = fuse_calls(fwd, GATED, "gate_up_proj")
        if isinstance(fwd, str):
            return None
        attr, ctor, out = (
            "gate_up_proj",
            "MergedColumnParallelLinear",
            f"[{first.out_features}, {up.out_features}]",
        )
    elif half is not None and _only_halved(fwd, columns[0]):  # [gate; up] on disk
        attr, ctor, out = columns[0], "MergedColumnParallelLinear", f"[{code(half)}, {code(half)}]"
    elif _SPLITS.search(code(fwd.body)):  # a contiguous shard of a column cut otherwise would mix its parts
        return None
    else:
        attr, ctor, out = columns[0], "ColumnParallelLinear", first.out_features
    exit_at = exit_point(fwd, row) if adds_after else None  # on forward as fused above
    if adds_after and exit_at is None:
        return None
    fwd = wrap_region(fwd, exit_at)
    if fwd is None:
        return None
    fused = named is not None
    changes = {
        id(linears[a].line): []
        if fused
        else [parallel_layer(a, ctor, args[a].layer_args(), GROUP, linears[a].line)]
        for a in columns[1:]
    }
    changes[id(linears[columns[0]].line)] = [
        parallel_layer(attr, ctor, first.layer_args(out), GROUP, linears[columns[0]].line)
    ]
    row_args = [*down.layer_args(), "reduce_results=False"]
    changes[id(linears[row].line)] = [
        parallel_layer(row, "RowParallelLinear", row_args, GROUP, linears[row].line)
    ]
    name = cls.name.value
    fused_name = f" {attr}" if ctor == "MergedColumnParallelLinear" else ""
    ctx.rewrites += [
        f"{name}: {'/'.join(columns)} -> {ctor}{fused_name} ({GROUP})",
        f"{name}: {row} -> RowParallelLinear ({GROUP})",
    ]
    if fused and len(columns) == 2:
        ctx.fused += [s for s in STACKED if s not in ctx.fused]
    used |= {ctor, "RowParallelLinear"}
    return replace_methods(cls, {"__init__": edit_body(init, changes, [region(GROUP)]), "forward": fwd})


def _opener(cls: cst.ClassDef) -> Layer | None:
    """The one linear of cls when cls opens an MLP split over two modules (BERT's Intermediate): forward applies it
    first, to its first argument (applied_first), then only passes its output through attributes __init__ sets
    without building anything (an activation: `ACT2FN[...]`), `y = self.<act>(y)`, and returns it: each acts on one
    column at a time, which a rank holds its share of."""
    if (layer := applied_first(cls)) is None:
        return None
    init, fwd = method(cls, "__init__"), method(cls, "forward")
    body = [s for s in fwd.body.body if not is_docstring(s)]
    y = body[0].body[0].targets[0].target.value
    built = {
        t.target.attr.value
        for a in findall(init, m.Assign())
        if findall(a.value, m.Call())
        for t in a.targets
        if m.matches(t.target, SELF_ATTR)
    }
    act = m.Call(m.Attribute(m.Name("self"), m.Name()), [m.Arg(m.Name(y), keyword=None)])
    step = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name(y))], act)])
    done = m.SimpleStatementLine([m.Return(act | m.Name(y))])
    if not all(m.matches(s, step) for s in body[1:-1]) or not m.matches(body[-1], done):
        return None
    return None if built & {a.attr.value for a in findall(fwd, SELF_ATTR)} - {layer.attr} else layer


def _rewrite_split(
    cls: cst.ClassDef, module: cst.Module, ctx: ParallelRewriteContext, used: set[str]
) -> list[cst.ClassDef]:
    """cls and the closing half of the MLP it opens, sharded (see _split_unit; the layer classes they use added
    to `used`), or none of them."""
    if (layer := _opener(cls)) is None or (closer := closing_half(module, cls.name.value)) is None:
        return []
    up, down = linear_args(layer.call), linear_args(closer.linear.call)
    fwd = enter_region(method(cls, "forward"))
    if up.out_features != down.in_features or fwd is None:
        return []
    init = method(cls, "__init__")
    column = parallel_layer(layer.attr, "ColumnParallelLinear", up.layer_args(), GROUP, layer.line)
    new_init = edit_body(init, {id(layer.line): [column]}, [region(GROUP)])
    name, closing = cls.name.value, closer.cls.name.value
    ctx.rewrites += [
        f"{name}: {layer.attr} -> ColumnParallelLinear ({GROUP})",
        f"{closing}: {closer.linear.attr}, which {name}'s output is handed to, -> RowParallelLinear ({GROUP})",
    ]
    used |= {"ColumnParallelLinear", "RowParallelLinear"}
    return [replace_methods(cls, {"__init__": new_init, "forward": fwd}), closed(closer, GROUP)]


class ShardMLP(Rule):
    ID = "PR002"
    DESCRIPTION = "Dense MLPs are sharded along the intermediate size: MergedColumn / RowParallelLinear."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        ctx = self.rewrite
        used: set[str] = set()
        new = {}
        for name, cls in classes(module).items():
            if name in new or method(cls, "__init__") is None or has_region(cls):
                continue
            if (result := _rewrite(cls, ctx, used)) is not None:
                new[name] = result
            elif split := _rewrite_split(cls, module, ctx, used):
                new |= {c.name.value: c for c in split}
        if not new:
            return module
        self.add_needed_imports([*((LINEAR_IMPORT, c) for c in sorted(used)), *REGION_IMPORTS])
        return replace_classes(module, new)
