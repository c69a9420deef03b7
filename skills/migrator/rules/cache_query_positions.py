"""Query positions counted from the offset a cache reports become the positions the runtime gives each token:

    if cache is not None:
        q_offset = cache.get_query_offset(self.layer_idx)
        ...
    else:
        q_offset = 0
    q_positions = torch.arange(q_length, device=hidden_states.device) + q_offset
->
    q_positions = forward_metadata.positions

MG004 folds the cache away and keeps the uncached branch, whose offset (0) would restart every step's positions at
0 (Inkling's log scaling of the queries reads them). Runs before MG004, while the offset's source shows."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import (
    Transformer,
    assigned_names,
    findall,
    param_names,
    with_forward_metadata,
)
from skills.migrator.rule import Rule
from skills.migrator.rules.fold_hf_only_params import CACHES

ARANGE = m.Call(
    func=m.Attribute(m.Name("torch"), m.Name("arange")), args=[m.Arg(keyword=None), m.ZeroOrMore()]
)
POSITIONS = "forward_metadata.positions"


def _offsets(fn: cst.FunctionDef) -> set[str]:
    """Names fn binds to `<cache parameter>.get_query_offset(...)`."""
    caches = set(param_names(fn)) & CACHES
    read = m.Call(func=m.Attribute(m.OneOf(*map(m.Name, caches)), m.Name("get_query_offset")))
    return {n for a in findall(fn.body, m.Assign(value=read)) for n in assigned_names(a)} if caches else set()


def _counted_from(value: cst.BaseExpression, offsets: set[str]) -> bool:
    """value is `torch.arange(n, ...) + offset` (either way round) with offset one of offsets."""
    if not m.matches(value, m.BinaryOperation(operator=m.Add())):
        return False
    sides = (value.left, value.right)
    return any(
        m.matches(a, ARANGE) and m.matches(b, m.Name()) and b.value in offsets
        for a, b in (sides, sides[::-1])
    )


class _Positions(Transformer):
    def __init__(self) -> None:
        self.offsets: list[set[str]] = []  # per enclosing function: its names bound to the query offset
        self.rewritten: list[bool] = []
        self.changed = False

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.offsets.append(_offsets(node))
        self.rewritten.append(False)

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        self.offsets.pop()
        return with_forward_metadata(updated) if self.rewritten.pop() else updated

    def leave_Assign(self, original: cst.Assign, updated: cst.Assign) -> cst.Assign:
        if not (self.offsets and _counted_from(updated.value, self.offsets[-1])):
            return updated
        self.rewritten[-1] = self.changed = True
        return updated.with_changes(value=cst.parse_expression(POSITIONS))


class CacheQueryPositions(Rule):
    ID = "MG039"
    DESCRIPTION = "Query positions counted from the cache's query offset become the runtime's positions."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        positions = _Positions()
        module = module.visit(positions)
        if positions.changed:
            self.add_needed_import("runtime.engine.forward_metadata", "ForwardMetaData")
        return module
