"""Where this file builds its classes and calls their instances, for the rules that change signatures: a
parameter can only go, or become required, when every call that binds it is known."""

from collections import defaultdict
from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import SELF_ATTR, choices, classes, findall, method, walk


def named_params(fn: cst.FunctionDef) -> list[cst.Param]:
    p = fn.params
    return [*p.posonly_params, *p.params, *p.kwonly_params]


def positional_params(fn: cst.FunctionDef) -> list[cst.Param]:
    return [x for x in (*fn.params.posonly_params, *fn.params.params) if x.name.value != "self"]


def binding(call: cst.Call, fn: cst.FunctionDef, param: cst.Param) -> cst.Arg | None:
    """The argument of call that binds param (None: the default is used)."""
    positional = [a for a in call.args if a.keyword is None and not a.star]
    order = [x.name.value for x in positional_params(fn)]
    name = param.name.value
    if name in order and order.index(name) < len(positional):
        return positional[order.index(name)]
    return next((a for a in call.args if a.keyword is not None and a.keyword.value == name), None)


def bound_parameter(call: cst.Call, fn: cst.FunctionDef, arg: cst.Arg) -> str | None:
    """The name of fn's parameter that arg of call binds (None: none, a splat or a keyword fn lacks)."""
    return next((p.name.value for p in named_params(fn) if binding(call, fn, p) is arg), None)


@dataclass
class Sites:
    """Where a class is built and where its instances are called, and whether that is all of their uses."""

    constructed: list[cst.Call] = field(default_factory=list)
    called: list[cst.Call] = field(default_factory=list)
    name_escapes: bool = False  # its name is used other than in the constructor calls
    instances_escape: bool = False  # an instance is used other than in the calls
    # calls of a list's items that may run another class instead (Zamba's layers: hybrid and Mamba ones)
    shared: list[cst.Call] = field(default_factory=list)


OPTIONAL = m.IfExp(body=m.Name("None"), orelse=m.Call()) | m.IfExp(body=m.Call(), orelse=m.Name("None"))
IS_NONE = m.Comparison(
    left=SELF_ATTR, comparisons=[m.ComparisonTarget(m.Is() | m.IsNot(), comparator=m.Name("None"))]
)


CAST = m.Call(func=m.Attribute(value=m.Call(func=m.Name()), attr=m.Name("to")))


def _uncast(e: cst.BaseExpression) -> cst.BaseExpression:
    """`C(...)` of `C(...).to(...)` (Inkling's `InklingShortConvolution(...).to(dtype=torch.float32)`), else e."""
    return e.func.value if m.matches(e, CAST) else e


def instance_attrs(init: cst.FunctionDef, local: set[str]) -> dict[str, tuple[str, bool]]:
    """`self.a = C(...)` (or `None if c else C(...)`, or `C(...).to(...)`) -> a: (C, False);
    `self.a = nn.ModuleList([C(...) ...])` -> a: (C, True)."""
    found = {}
    for a in findall(init, m.Assign(targets=[m.AssignTarget(SELF_ATTR)], value=m.Call() | OPTIONAL)):
        call, attr = a.value, a.targets[0].target.attr.value
        if isinstance(call, cst.IfExp):
            call = call.body if isinstance(call.body, cst.Call) else call.orelse
        call = _uncast(call)
        if m.matches(call.func, m.Name()) and call.func.value in local:
            found[attr] = (call.func.value, False)
        elif m.matches(call.func, m.Attribute(attr=m.Name("ModuleList"))):
            if not call.args:  # `self.a = nn.ModuleList()`, then `self.a.append(C(...))`
                kinds = (
                    _appended_kinds(init, f"self.{attr}", local)
                    if _only_appended(init, f"self.{attr}")
                    else set()
                )
            elif isinstance(listed := call.args[0].value, cst.Name):  # `items = []`, `items.append(...)`
                kinds = (
                    _appended_kinds(init, listed.value, local)
                    if _only_appended(init, listed.value)
                    else set()
                )
            else:
                kinds = {
                    c.func.value for c in findall(listed, m.Call(func=m.Name())) if c.func.value in local
                }
            if len(kinds) == 1:
                found[attr] = (kinds.pop(), True)
    return found


def builders(cls: cst.ClassDef) -> dict[str, cst.FunctionDef]:
    """The class's own methods its __init__ calls (`self.layers = self.get_layers()`: Zamba2 builds its layers
    in one), by name: they construct on __init__'s behalf."""
    init = method(cls, "__init__")
    called = {c.func.attr.value for c in findall(init, m.Call(SELF_ATTR))} if init else set()
    return {
        f.name.value: f
        for f in cls.body.body
        if isinstance(f, cst.FunctionDef) and f.name.value in called - {"__init__", "forward"}
    }


MODULE_LIST = m.Call(m.Attribute(attr=m.Name("ModuleList")), [m.Arg(m.Name())])


def mixed_lists(cls: cst.ClassDef, local: set[str]) -> dict[str, set[str]]:
    """`self.a = nn.ModuleList(items)` of a list `items` that `items.append(...)` fills with instances of more
    than one in-file class (built in the call, or by a local: Zamba's `mamba = ZambaMambaDecoderLayer(...)`)
    -> a: those classes. The list may be built by a builder method (`self.a = self.get_layers()`, which returns
    `nn.ModuleList(items)`)."""
    init = method(cls, "__init__")
    found = {}
    for a in findall(init, m.Assign([m.AssignTarget(SELF_ATTR)], MODULE_LIST)) if init else ():
        found[a.targets[0].target.attr.value] = _appended_kinds(init, a.value.args[0].value.value, local)
    for name, fn in builders(cls).items():
        built_by = m.Assign([m.AssignTarget(SELF_ATTR)], m.Call(m.Attribute(m.Name("self"), m.Name(name))))
        for a in findall(init, built_by):
            for r in findall(fn, m.Return(MODULE_LIST)):
                found[a.targets[0].target.attr.value] = _appended_kinds(
                    fn, r.value.args[0].value.value, local
                )
    return {attr: kinds for attr, kinds in found.items() if len(kinds) > 1}


def chosen_classes(init: cst.FunctionDef | None, local: set[str]) -> dict[str, set[str]]:
    """`self.a = A(...) if c else B(...)` (either perhaps cast, `B(...).to(...)`) of two in-file classes -> a: both
    (Inkling2's `Inkling2LogScaledL2Clip(...) if log_scaling else Inkling2ScaledL2Clip(...)`)."""
    found = {}
    for a in findall(init, m.Assign([m.AssignTarget(SELF_ATTR)], m.IfExp())) if init else ():
        arms = [_uncast(x) for x in (a.value.body, a.value.orelse)]
        kinds = {x.func.value for x in arms if m.matches(x, m.Call(m.Name()))} & local
        if len(kinds) == 2:
            found[a.targets[0].target.attr.value] = kinds
    return found


def _held(items: str) -> m.BaseMatcherNode:
    """A local's name, or `self.<attr>`."""
    return m.Name(items) if "." not in items else m.Attribute(m.Name("self"), m.Name(items.split(".")[1]))


def _only_appended(fn: cst.FunctionDef, items: str) -> bool:
    """fn adds to the list `items` (a local bound once, to `[]`, or `self.<attr>`) only by `.append(...)`."""
    held = _held(items)
    grown = m.Call(m.Attribute(held, m.Name("extend") | m.Name("insert"))) | m.AugAssign(held)
    if findall(fn, grown):
        return False
    if "." in items:
        return True
    bound = findall(fn, m.AssignTarget(held))
    return len(bound) == 1 and len(findall(fn, m.Assign([m.AssignTarget(held)], m.List([])))) == 1


def _appended_kinds(fn: cst.FunctionDef, items: str, local: set[str]) -> set[str]:
    """The in-file classes fn's `<items>.append(...)` calls add instances of (items: a local's name, or
    `self.<attr>`)."""
    built = m.Call(m.Name(m.MatchIfTrue(lambda n: n in local)))
    made = defaultdict(set)  # local -> the classes assigned to it
    for a in findall(fn, m.Assign([m.AssignTarget(m.Name())], built)):
        made[a.targets[0].target.value].add(a.value.func.value)
    kinds = set()
    for c in findall(fn, m.Call(m.Attribute(_held(items), m.Name("append")), [m.Arg()])):
        for item in choices(c.args[0].value):
            if m.matches(item, built):
                kinds.add(item.func.value)
            elif isinstance(item, cst.Name):
                kinds |= made.get(item.value, set())
    return kinds


class _Index(cst.CSTVisitor):
    """One pass over the module: names, constructor-style calls, and per class its `self.<attr>` reads,
    calls and loops (imports are skipped)."""

    def __init__(self) -> None:
        self.owner: list[str] = []
        self.names: dict[str, list[cst.Name]] = defaultdict(list)
        self.calls: dict[str, list[cst.Call]] = defaultdict(list)  # `Name(...)` by name
        self.self_attrs: dict[tuple[str, str], list[cst.Attribute]] = defaultdict(list)
        self.self_calls: dict[tuple[str, str], list[cst.Call]] = defaultdict(list)
        self.loops: dict[tuple[str, str], list[cst.For]] = defaultdict(list)
        self.other_attrs: set[str] = set()  # attributes read off something else than self (self.model.<attr>)
        self.member_reads: set[int] = set()  # ids of `self.a` in a load of `self.a.b` (b not forward)
        self.stores: set[int] = set()  # ids of assignment targets
        self.none_tests: set[int] = set()  # ids of `self.a` in `self.a is None` / `self.a is not None`

    def visit_Import(self, node: cst.Import) -> bool:
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.owner.append(node.name.value)

    def leave_ClassDef(self, node: cst.ClassDef) -> None:
        self.owner.pop()

    def _key(self, attr: str) -> tuple[str, str]:
        return (self.owner[-1] if self.owner else "", attr)

    def visit_Name(self, node: cst.Name) -> None:
        self.names[node.value].append(node)

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Name):
            self.calls[node.func.value].append(node)
        elif m.matches(node.func, SELF_ATTR):
            self.self_calls[self._key(node.func.attr.value)].append(node)

    def visit_Comparison(self, node: cst.Comparison) -> None:
        if m.matches(node, IS_NONE):
            self.none_tests.add(id(node.left))

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self.stores.add(id(node.target))

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if m.matches(node, SELF_ATTR):
            self.self_attrs[self._key(node.attr.value)].append(node)
        else:
            self.other_attrs.add(node.attr.value)
            loaded = id(node) not in self.stores and node.attr.value not in ("forward", "__call__")
            if loaded and m.matches(node.value, SELF_ATTR):
                self.member_reads.add(id(node.value))

    def visit_For(self, node: cst.For) -> None:
        if (over := loop_over(node)) is not None:
            self.loops[self._key(over[0].attr.value)].append(node)


def loop_over(loop: cst.For) -> tuple[cst.Attribute, str] | None:
    """(`self.layers`, the loop variable) of `for layer in self.layers[...]`, `for i, layer in
    enumerate(self.layers[...])`, or either over `zip(self.layers, ...)` with the variables unpacked (GPT-2 of
    transformers 4.2x: `for i, (block, layer_past) in enumerate(zip(self.h, past_key_values))`), else None."""
    over, target = loop.iter, loop.target
    counted = m.Call(m.Name("enumerate"), [m.Arg(keyword=None), m.ZeroOrOne(m.Arg(keyword=m.Name("start")))])
    if m.matches(over, counted) and m.matches(target, m.Tuple([m.Element(m.Name()), m.Element()])):
        over, target = over.args[0].value, target.elements[1].value
    if m.matches(over, m.Call(func=m.Name("zip"))) and isinstance(target, cst.Tuple):
        held = [i for i, a in enumerate(over.args) if m.matches(_unsliced(a.value), SELF_ATTR)]
        if len(held) != 1 or len(target.elements) != len(over.args) or any(a.star for a in over.args):
            return None
        over, target = over.args[held[0]].value, target.elements[held[0]].value
    over = _unsliced(over)
    return (over, target.value) if isinstance(target, cst.Name) and m.matches(over, SELF_ATTR) else None


def _unsliced(e: cst.BaseExpression) -> cst.BaseExpression:
    return e.value if isinstance(e, cst.Subscript) else e


def call_sites(module: cst.Module) -> dict[str, Sites]:
    local = classes(module)
    sites = {name: Sites() for name in local}
    index = _Index()
    walk(index, module)
    accounted: set[int] = set()  # ids of the Name nodes the constructor calls explain
    for name, cls in local.items():
        accounted.add(id(cls.name))
        sites[name].constructed = index.calls[name]
        accounted.update(id(call.func) for call in index.calls[name])
    for owner, cls in local.items():
        init = method(cls, "__init__")
        for attr, (target, is_list) in (instance_attrs(init, set(local)) if init else {}).items():
            assigned = findall(init, m.AssignTarget(m.Attribute(value=m.Name("self"), attr=m.Name(attr))))
            explained = {id(t.target) for t in assigned}
            if is_list:
                for loop in index.loops[(owner, attr)]:
                    over, var = loop_over(loop)
                    explained.add(id(over))
                    calls = findall(loop.body, m.Call(func=m.Name(var)))
                    sites[target].called += calls
                    if len(calls) != len(findall(loop.body, m.Name(var))):
                        sites[target].instances_escape = True
            else:
                sites[target].called += index.self_calls[(owner, attr)]
                explained.update(id(call.func) for call in index.self_calls[(owner, attr)])
            uses = index.self_attrs[(owner, attr)]
            explained |= index.member_reads | index.none_tests
            if any(id(u) not in explained for u in uses) or attr in index.other_attrs:
                sites[target].instances_escape = True
        for attr, kinds in mixed_lists(cls, set(local)).items():
            calls = [
                c
                for loop in index.loops[(owner, attr)]
                for c in findall(loop.body, m.Call(m.Name(loop_over(loop)[1])))
            ]
            for kind in kinds:  # no rule may change one class's signature for these calls alone
                sites[kind].shared += calls
                sites[kind].instances_escape = True
        for kinds in chosen_classes(init, set(local)).values():  # the calls instance_attrs gives the first
            for kind in kinds:
                sites[kind].instances_escape = True
    for name, where in sites.items():
        where.name_escapes = any(id(node) not in accounted for node in index.names[name])
    return sites
