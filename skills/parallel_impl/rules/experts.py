"""An experts module (parameters stacked per expert, `forward(hidden_states, top_k_index, top_k_weights)`, as
transformers' MoE layers are written) is split over moe_ep_group: each rank builds only its block of experts
(`ExpertParallel.local_experts` in place of the expert count), their loaders read only those, and `forward`
runs the module's own math on the (token, expert) pairs routed to them (`run_experts`, the original forward)
through `ExpertParallel`'s dispatch and combine. The router stays replicated.

Matched by structure, not by name; a class that doesn't match is left whole on every rank, without a finding."""

from __future__ import annotations

from typing import TYPE_CHECKING

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import classes, method, names_in, param_names, stmt
from skills.migrator.expert_params import ExpertParam, expert_params
from skills.migrator.rule import Rule
from skills.parallel_impl.rules._units import code, edit_body, plumbed, replace_classes

if TYPE_CHECKING:
    from skills.parallel_impl.rewrite import ParallelRewriteContext

GROUP = "moe_ep_group"
ATTR = "expert_parallel"
LOCAL = "run_experts"


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

    def ctor(count: cst.BaseExpression) -> cst.SimpleStatementLine:
        return stmt(
            f"self.{ATTR} = ExpertParallel({code(count)}, infer_config, comm_manager, "
            f'ep_group="{GROUP}", prefix=prefix)\n'
        )

    changes: dict[int, list[cst.BaseStatement]] = {}
    if (source := _count_source(init, lead, params[0])) is not None:  # self.num_experts = config.num_experts
        changes[id(source)] = [
            ctor(source.body[0].value).with_changes(leading_lines=source.leading_lines),
            stmt(f"{code(source.body[0].targets[0].target)} = {local}\n"),
        ]
    else:  # the count written in each shape
        for p in params:
            changes[id(p.line)] = [p.line.deep_replace(p.dims[0], cst.parse_expression(local))]
        first = changes[id(params[0].line)]
        first.insert(0, ctor(lead).with_changes(leading_lines=params[0].line.leading_lines))
        first[1] = first[1].with_changes(leading_lines=[])
    shard = stmt(f"self.{ATTR}.shard({', '.join(f'self.{p.attr}' for p in params)})\n")
    last = changes.setdefault(id(params[-1].line), [params[-1].line])
    last.append(shard)
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
    ctx.rewrites.append(
        f"{name}: {'/'.join(p.attr for p in params)} -> this rank's experts of {GROUP} (ExpertParallel)"
    )
    return cls.with_changes(body=cls.body.with_changes(body=body))


class ShardExperts(Rule):
    ID = "PR007"
    DESCRIPTION = (
        "Experts modules hold this rank's block of experts; tokens reach them through ExpertParallel."
    )

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        new = {
            name: result for name, cls in classes(module).items() if (result := _rewrite(cls, self.rewrite))
        }
        if not new:
            return module
        self.add_needed_imports([("runtime.layers.moe", "ExpertParallel")])
        return replace_classes(module, new)
