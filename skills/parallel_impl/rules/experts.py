"""An experts module (parameters stacked per expert, `forward(hidden_states, top_k_index, top_k_weights)`, as
transformers' MoE layers are written) is split over moe_ep_group: each rank builds only its block of experts
(`ExpertParallel.local_experts` in place of the expert count), their loaders read only those, and `forward`
runs the module's own math on the (token, expert) pairs routed to them (`run_experts`, the original forward)
through `ExpertParallel`'s dispatch and combine. The router stays replicated.

Expert TP (moe_tp_group) is added where the shapes say how: the dimension every stacked weight shares is the
hidden size, the other one of each is the intermediate size (`2 * X`: gate and up fused, as halves when forward
`.chunk`s them, interleaved pairs when it slices `::2`); a per-expert bias over the intermediate size is split
with it, one over the hidden size is added once. Each rank then builds `tp_part(X)` of it.

Matched by structure, not by name; a class that doesn't match is left whole on every rank, without a finding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import (
    Transformer,
    classes,
    doubled,
    findall,
    method,
    names_in,
    param_names,
    stmt,
)
from skills.migrator.expert_params import ExpertParam, expert_params
from skills.migrator.rule import Rule
from skills.parallel_impl.rules._units import code, edit_body, plumbed, replace_classes

if TYPE_CHECKING:
    from skills.parallel_impl.rewrite import ParallelRewriteContext

GROUP = "moe_ep_group"
TP_GROUP = "moe_tp_group"
ATTR = "expert_parallel"
LOCAL = "run_experts"
_INTERLEAVED = m.Slice(step=m.Integer("2"))  # gate_up[..., ::2] / [..., 1::2]
_HALVED = m.Call(func=m.Attribute(attr=m.Name("chunk")), args=[m.Arg(m.Integer("2")), m.ZeroOrMore()])


def _routed_forward(fwd: cst.FunctionDef | None) -> bool:
    """forward(self, hidden_states, top_k_index, top_k_weights): three plain positional parameters."""
    if fwd is None or not isinstance(fwd.body, cst.IndentedBlock):
        return False
    p = fwd.params
    plain = len(p.params) == 4 and not (p.posonly_params or p.kwonly_params or p.star_kwarg)
    return plain and not isinstance(p.star_arg, cst.Param) and all(x.default is None for x in p.params)


def _count_source(
    init: cst.FunctionDef, lead: cst.BaseExpression, first: ExpertParam
) -> cst.BaseStatement | None:
    """The top-level `self.X = <count>` before the first stacked parameter, when the lead size is `self.X`."""
    if not m.matches(lead, m.Attribute(m.Name("self"), m.Name())):
        return None
    target = m.SimpleStatementLine(
        [m.Assign([m.AssignTarget(m.Attribute(m.Name("self"), m.Name(lead.attr.value)))])]
    )
    body = list(init.body.body)
    found = [s for s in body[: body.index(first.line)] if m.matches(s, target)]
    return found[-1] if found else None


@dataclass(frozen=True)
class _TPSplit:
    sizes: dict[int, cst.BaseExpression]  # id(parameter line) -> the intermediate size's node in its shape
    shard_args: dict[str, str]  # attribute -> ExpertParallel.shard's keywords


def _tp_split(params: list[ExpertParam], methods: list[cst.FunctionDef]) -> _TPSplit | None:
    """How each stacked parameter splits over moe_tp_group, None when the shapes or the methods that compute with
    them (forward and its helpers) leave it unclear."""

    def found(pattern: m.BaseMatcherNode) -> list[cst.CSTNode]:
        return [n for f in methods for n in findall(f, pattern)]

    stacked = [p for p in params if len(p.dims) == 3]
    if len(stacked) != sum(len(p.dims) >= 3 for p in params):
        return None
    dims = [[code(d) for d in p.dims[1:]] for p in stacked]
    common = set.intersection(*map(set, dims))
    if len(common) != 1:
        return None
    (hidden,) = common
    interleaved, halved = bool(found(_INTERLEAVED)), bool(found(_HALVED))
    sizes, shard_args, by_size = {}, {}, {}
    for p, codes in zip(stacked, dims, strict=True):
        split = [i for i, c in enumerate(codes, 1) if c != hidden]
        if len(split) != 1:
            return None
        size = p.dims[split[0]]
        inner = doubled(size)
        if inner is not None and interleaved == halved:  # how gate and up share the dimension is unclear
            return None
        halves = ", halves=True" if inner is not None and halved else ""
        sizes[id(p.line)] = inner or size
        shard_args[p.attr] = f"tp_dim={split[0]}{halves}"
        by_size[code(size)] = (f"tp_dim=1{halves}", inner)
    if len({code(s) for s in sizes.values()}) != 1:
        return None
    for p in params:
        if len(p.dims) != 2:
            continue
        bias = code(p.dims[1])
        if bias == hidden:  # added after the intermediate sum: once
            shard_args[p.attr] = "once=True"
        elif bias in by_size:
            shard_args[p.attr], inner = by_size[bias]
            sizes[id(p.line)] = p.dims[1] if inner is None else doubled(p.dims[1])
        else:
            return None
    read = {a.attr.value for a in found(m.Attribute(m.Name("self"), m.Name()))}
    if any(
        findall(s, m.Attribute(m.Name("self"), m.Name(m.MatchIfTrue(read.__contains__))))
        for s in sizes.values()
    ):
        return None  # the computation reads the whole intermediate size
    return _TPSplit(sizes, shard_args)


class _Replace(Transformer):
    """Nodes of the original tree (by identity) replaced by code."""

    def __init__(self, new: dict[int, str]):
        self.new = new

    def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode) -> cst.CSTNode:
        if id(original) in self.new:
            return cst.parse_expression(self.new[id(original)])
        return updated


def _rewrite(cls: cst.ClassDef, ctx: ParallelRewriteContext) -> cst.ClassDef | None:
    init, fwd = method(cls, "__init__"), method(cls, "forward")
    if (
        init is None
        or not plumbed(init)
        or "infer_config" not in param_names(init)
        or not _routed_forward(fwd)
    ):
        return None
    params = expert_params(init)
    if not params or {ATTR, LOCAL} & names_in(cls):
        return None
    lead = params[0].dims[0]
    local = f"self.{ATTR}.local_experts"
    tp = _tp_split(params, [f for f in cls.body.body if isinstance(f, cst.FunctionDef) and f is not init])
    tp_group = f', tp_group="{TP_GROUP}"' if tp else ""

    def ctor(count: cst.BaseExpression) -> cst.SimpleStatementLine:
        return stmt(
            f"self.{ATTR} = ExpertParallel({code(count)}, infer_config, comm_manager, "
            f'ep_group="{GROUP}"{tp_group}, prefix=prefix)\n'
        )

    new_nodes: dict[int, str] = {}  # id(node in a shape) -> its code for this rank
    for p in params:
        if (
            size := tp.sizes.get(id(p.line)) if tp else None
        ) is not None:  # its share of the intermediate size
            new_nodes[id(size)] = f"self.{ATTR}.tp_part({code(size)})"
    source = _count_source(init, lead, params[0])
    if source is None:  # the count written in each shape
        new_nodes |= {id(p.dims[0]): local for p in params}
    changes: dict[int, list[cst.BaseStatement]] = {
        id(p.line): [p.line.visit(_Replace(new_nodes))] for p in params
    }
    if source is not None:  # self.num_experts = config.num_experts
        changes[id(source)] = [
            ctor(source.body[0].value).with_changes(leading_lines=source.leading_lines),
            stmt(f"{code(source.body[0].targets[0].target)} = {local}\n"),
        ]
    else:
        first = changes[id(params[0].line)]
        first.insert(0, ctor(lead).with_changes(leading_lines=params[0].line.leading_lines))
        first[1] = first[1].with_changes(leading_lines=[])
    groups: dict[str, list[str]] = {}  # shard keywords -> attributes, in order
    for p in params:
        groups.setdefault(tp.shard_args[p.attr] if tp else "", []).append(f"self.{p.attr}")
    changes[id(params[-1].line)] += [
        stmt(f"self.{ATTR}.shard({', '.join([*attrs, *([kw] if kw else [])])})\n")
        for kw, attrs in groups.items()
    ]
    args = [x.name.value for x in fwd.params.params[1:]]
    (forward,) = cst.parse_module(
        f"def forward(self):\n    return self.{ATTR}(self.{LOCAL}, {', '.join(args)})\n"
    ).body
    forward = forward.with_changes(params=fwd.params, returns=fwd.returns, leading_lines=fwd.leading_lines)
    run = fwd.with_changes(name=cst.Name(LOCAL), leading_lines=[cst.EmptyLine(indent=False)])
    body = []
    for s in cls.body.body:
        if s is init:
            body.append(edit_body(init, changes))
        elif s is fwd:
            body += [forward, run]
        else:
            body.append(s)
    name = cls.name.value
    split = f" and their intermediate share of {TP_GROUP}" if tp else ""
    ctx.rewrites.append(
        f"{name}: {'/'.join(p.attr for p in params)} -> this rank's experts of {GROUP}{split} (ExpertParallel)"
    )
    return cls.with_changes(body=cls.body.with_changes(body=body))


class ShardExperts(Rule):
    ID = "PR007"
    DESCRIPTION = "Experts modules hold this rank's experts (and intermediate share) behind ExpertParallel."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        new = {
            name: result for name, cls in classes(module).items() if (result := _rewrite(cls, self.rewrite))
        }
        if not new:
            return module
        self.add_needed_imports([("runtime.layers.moe", "ExpertParallel")])
        return replace_classes(module, new)
