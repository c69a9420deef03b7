"""Positions a module computes from the past length HF reads off its cache, given to it instead (MG004): a call
passing that length to a module whose forward also takes `position_ids`, and reads the length only when none are
given (TrOCR's learned positional embedding, `arange(cache_length, cache_length + seq_len)`), passes the
positions the runtime gives each token; the calling function takes them as a parameter if it did not. A config
branch the checkpoint does not take that builds or calls such a module first becomes a guard, so a checkpoint
whose module computes them otherwise (TrOCR's sinusoidal embedding counts non-pad tokens) is still refused."""

import libcst as cst
import libcst.matchers as m
from transformers import PretrainedConfig

from skills.migrator.call_sites import binding, call_sites, instance_attrs, named_params
from skills.migrator.cst_utils import (
    Transformer,
    appended,
    assigned_names,
    classes,
    findall,
    free_names,
    method,
    param_names,
    with_args,
)
from skills.migrator.rules.checkpoint_branches import guard_untaken_branches

SELF_CALL = m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name()))
POSITIONS = m.Name("position_ids")
WITHOUT_POSITIONS = m.If(test=m.Comparison(POSITIONS, [m.ComparisonTarget(m.Is(), m.Name("None"))]))
# forward adds the batch dimension to the positions it is given itself: it takes one row
ADDS_BATCH = m.Assign(
    [m.AssignTarget(POSITIONS)],
    m.Call(m.Attribute(POSITIONS, m.Name("unsqueeze")), [m.Arg(m.Integer("0"))])
    | m.Subscript(POSITIONS, [m.SubscriptElement(m.Index(m.Name("None")))]),
)

Lengths = dict[tuple[str, str], set[str]]


def fed_past_length(fn: cst.FunctionDef, lengths: set[str]) -> list[cst.Call]:
    """fn's `self.<module>(...)` calls with an argument reading a past length and none reading positions."""
    return [
        c for c in findall(fn, SELF_CALL) if (read := free_names(c)) & lengths and "position_ids" not in read
    ]


def _built(init: cst.FunctionDef | None, attr: str) -> list[str]:
    """The classes `self.<attr> = C(...)` lines of init build."""
    target = m.AssignTarget(m.Attribute(m.Name("self"), m.Name(attr)))
    return [a.value.func.value for a in findall(init, m.Assign([target], m.Call(m.Name())))] if init else []


def _length_args(call: cst.Call, lengths: set[str]) -> list[cst.Arg]:
    return [a for a in call.args if free_names(a.value) & lengths]


def _takes_positions(call: cst.Call, callee: cst.ClassDef | None, lengths: set[str]) -> bool:
    """callee's forward takes `position_ids` and reads what call passes it the length as only when none are given."""
    fwd = method(callee, "forward") if callee is not None else None
    if fwd is None or "position_ids" not in param_names(fwd):
        return False
    bound = {id(a): p.name.value for p in named_params(fwd) if (a := binding(call, fwd, p)) is not None}
    positional = [a for a in call.args if a.keyword is None]
    for arg in _length_args(call, lengths):
        name = bound.get(id(arg))
        if name is None or (arg.keyword is None and arg is not positional[-1]):
            return False  # an argument after it would shift once it goes
        reads = len(findall(fwd.body, m.Name(name)))
        inside = sum(len(findall(i.body, m.Name(name))) for i in findall(fwd.body, WITHOUT_POSITIONS))
        if reads != inside:
            return False
    return True


def _token_count(fn: cst.FunctionDef) -> m.BaseMatcherNode | None:
    """What reads the number of tokens fn is given (its first parameter, the ids: nanoGPT's `idx`): `ids.size(1)`,
    `ids.shape[-1]`, ..., or a name bound to one, or to the second of `b, t = ids.size()`."""
    params = [p for p in param_names(fn) if p != "self"]
    if not params:
        return None
    ids = m.Name(params[0])
    last = m.Integer("1") | m.UnaryOperation(m.Minus(), m.Integer("1"))
    read = m.Call(m.Attribute(ids, m.Name("size")), [m.Arg(last)]) | m.Subscript(
        m.Attribute(ids, m.Name("shape")), [m.SubscriptElement(m.Index(last))]
    )
    whole = m.Call(m.Attribute(ids, m.Name("size")), []) | m.Attribute(ids, m.Name("shape"))
    pair = m.Tuple([m.Element(m.Name()), m.Element(m.Name())])
    names = [a.targets[0].target.value for a in findall(fn, m.Assign([m.AssignTarget(m.Name())], read))]
    names += [
        a.targets[0].target.elements[1].value.value
        for a in findall(fn, m.Assign([m.AssignTarget(pair)], whole))
    ]
    once = [
        n for n in names if sum(n in assigned_names(s) for s in findall(fn, m.Assign() | m.AugAssign())) == 1
    ]
    return m.OneOf(read, *map(m.Name, once)) if once else read


def _counted_positions(fn: cst.FunctionDef) -> dict[cst.CSTNode, cst.CSTNode]:
    """In a model without a cache (every step reads the whole sequence again), `torch.arange(n)` or
    `torch.arange(0, n)` of the number of tokens fn is given are their positions: `position_ids[0]`. An assert
    on that number (nanoGPT's `t <= block_size`) goes (_without_count_asserts): the runtime packs every request's
    tokens in one row."""
    count = _token_count(fn)
    if count is None:
        return {}
    zero = m.Arg(m.Integer("0"), keyword=None)
    arange = m.Call(
        m.Attribute(m.Name("torch"), m.Name("arange")),
        [
            m.ZeroOrOne(zero),
            m.Arg(count, keyword=None),
            m.ZeroOrMore(m.Arg(keyword=m.Name() & ~m.Name("step"))),
        ],
    )
    return {c: cst.parse_expression("position_ids[0]") for c in findall(fn, arange)}


def _without_count_asserts(fn: cst.FunctionDef) -> cst.FunctionDef:
    """fn without its asserts on the number of tokens it is given (see _counted_positions)."""
    count = _token_count(fn)
    if count is None:
        return fn
    lines = [line for line in findall(fn.body, m.SimpleStatementLine([m.Assert()])) if findall(line, count)]
    return fn.visit(_Dropped({id(line) for line in lines})) if lines else fn


class _Dropped(Transformer):
    def __init__(self, ids: set[int]):
        self.ids = ids

    def leave_SimpleStatementLine(self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine):
        return cst.RemoveFromParent() if id(original) in self.ids else updated


def _current_positions(
    fn: cst.FunctionDef, lengths: set[str], entered: bool, uncached: bool
) -> dict[cst.BaseExpression, str]:
    """What fn computes the current tokens' positions with from a past length L, with what replaces it: the rows
    `table[L : L + n]` (or `[L : n + L]`) of a table indexed by position (Meta's `self.freqs_cis[start_pos :
    start_pos + seqlen]`) become `table[position_ids[0]]`, `torch.arange(L, L + n)` (or `(L, n + L)`) becomes
    `position_ids[0]` (GPT-2 of transformers 4.2x when it is not given positions). Only where fn is given the
    runtime's [1, T] positions: it takes `position_ids` and does not add their batch dimension itself, or it is
    the inner model's forward (entered), which the entry passes them to. In a model without a cache (uncached),
    see _counted_positions."""
    given = "position_ids" in param_names(fn)
    branches = {id(s) for i in findall(fn, WITHOUT_POSITIONS) for s in findall(i, ADDS_BATCH)}
    one_row = any(id(s) not in branches for s in findall(fn, ADDS_BATCH))
    if (given and one_row) or not (given or entered):
        return {}
    if uncached:
        return _counted_positions(fn)
    if not lengths:
        return {}
    length = m.OneOf(*map(m.Name, lengths))
    upper = m.BinaryOperation(length, m.Add()) | m.BinaryOperation(operator=m.Add(), right=length)
    rows = m.Subscript(slice=[m.SubscriptElement(m.Slice(lower=length, upper=upper, step=None))])
    found = {
        s: s.with_changes(slice=[cst.SubscriptElement(cst.Index(cst.parse_expression("position_ids[0]")))])
        for s in findall(fn, rows)
        if _one_length(s.slice[0].slice.lower, s.slice[0].slice.upper)
    }
    arange = m.Call(
        m.Attribute(m.Name("torch"), m.Name("arange")), [m.Arg(length), m.Arg(upper), m.ZeroOrMore()]
    )
    for c in findall(fn, arange):
        stepped = any(a.keyword is None or a.keyword.value == "step" for a in c.args[2:])
        if _one_length(c.args[0].value, c.args[1].value) and not stepped:
            found[c] = cst.parse_expression("position_ids[0]")
    return found


def _one_length(lower: cst.Name, upper: cst.BaseExpression) -> bool:
    """The past length that starts the range is the one added to its end."""
    return lower.value in free_names(upper)


def _fed_attrs(cls: cst.ClassDef, lengths: set[str]) -> set[str]:
    fns = [f for f in cls.body.body if isinstance(f, cst.FunctionDef)]
    return {c.func.attr.value for f in fns for c in fed_past_length(f, lengths)}


def _guard_untaken(module: cst.Module, config: PretrainedConfig | None, lengths: Lengths) -> cst.Module:
    """Untaken config branches that build or call a module fed a past length become guards."""
    fed = {
        name: _fed_attrs(cls, set().union(*(v for (c, _), v in lengths.items() if c == name)))
        for name, cls in classes(module).items()
    }

    def wanted(cls: cst.ClassDef, branch: cst.If) -> bool:
        attrs = fed.get(cls.name.value, set())
        calls = findall(branch.body, SELF_CALL)
        built = findall(branch.body, m.AssignTarget(m.Attribute(m.Name("self"), m.Name())))
        return any(c.func.attr.value in attrs for c in calls) or any(
            t.target.attr.value in attrs for t in built
        )

    return guard_untaken_branches(module, config, wanted, elses=True)


class _PassPositions(Transformer):
    def __init__(self, module: cst.Module, lengths: Lengths, entry_class: str, uncached: bool):
        self.local, self.lengths, self.cls, self.uncached = classes(module), lengths, None, uncached
        init = method(self.local[entry_class], "__init__") if entry_class in self.local else None
        self.inner = {c for c, _ in instance_attrs(init, set(self.local)).values()} if init else set()
        self.callees: set[str] = set()  # the classes now given positions

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.cls = node

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        self.cls = None
        return updated

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        lengths = self.lengths.get((self.cls.name.value, original.name.value), set()) if self.cls else set()
        init = method(self.cls, "__init__") if self.cls else None
        entered = (
            self.cls is not None and self.cls.name.value in self.inner and original.name.value == "forward"
        )
        if self.uncached and entered:
            updated = _without_count_asserts(updated)
        changed = _current_positions(updated, lengths, entered, self.uncached)
        for call in fed_past_length(updated, lengths):
            names = _built(init, call.func.attr.value)
            callees = [self.local.get(c) for c in names]
            if callees and all(_takes_positions(call, c, lengths) for c in callees):
                self.callees.update(names)
                row = all(findall(method(c, "forward"), ADDS_BATCH) for c in callees)
                dropped = {id(a) for a in _length_args(call, lengths)}
                kept = [a for a in call.args if id(a) not in dropped]
                changed[call] = appended(
                    with_args(call, kept), "position_ids", "position_ids[0]" if row else "position_ids"
                )
        if not changed:
            return updated
        for old, new in changed.items():
            updated = updated.deep_replace(old, new)
        if "position_ids" not in param_names(updated):
            param = cst.parse_expression("lambda position_ids=None: 0").params.params[0]
            updated = updated.with_changes(
                params=updated.params.with_changes(params=[*updated.params.params, param])
            )
        return updated


def _given_positions(module: cst.Module, changed: set[str]) -> cst.Module:
    """module with `if position_ids is None: ... else: B` in the forward of each class of changed, which every
    call now passes positions, folded to B (the past length it read there is then unread)."""
    sites, local = call_sites(module), classes(module)
    new = {}
    for name in changed:
        fwd = method(local[name], "forward")
        param = next(p for p in named_params(fwd) if p.name.value == "position_ids")
        if sites[name].instances_escape or not all(binding(c, fwd, param) for c in sites[name].called):
            continue
        folded = {
            id(i): list(i.orelse.body.body) if isinstance(i.orelse, cst.Else) else []
            for i in findall(fwd, WITHOUT_POSITIONS)
        }
        new[name] = local[name].deep_replace(fwd, fwd.visit(_Unfold(folded)))
    return module.with_changes(
        body=[new.get(s.name.value, s) if isinstance(s, cst.ClassDef) else s for s in module.body]
    )


class _Unfold(Transformer):
    """Each `if` of folded (by id) replaced by its statements (none: removed)."""

    def __init__(self, folded: dict[int, list[cst.BaseStatement]]):
        self.folded = folded

    def leave_If(self, original: cst.If, updated: cst.If):
        if id(original) not in self.folded:
            return updated
        kept = self.folded[id(original)]
        return cst.FlattenSentinel(kept) if kept else cst.RemoveFromParent()


def pass_positions(
    module: cst.Module, config: PretrainedConfig | None, lengths: Lengths, entry_class: str, uncached: bool
) -> cst.Module:
    """module with the untaken branches around modules fed a past length guarded, the positions passed to those
    that take them instead of the length, and their branch computing positions from it folded away; uncached:
    the model has no cache at all (see _counted_positions)."""
    module = _guard_untaken(module, config, lengths)
    passing = _PassPositions(module, lengths, entry_class, uncached)
    module = module.visit(passing)
    return _given_positions(module, passing.callees)
