"""Leftovers of the other rules go: locals nobody reads (values that only compute), methods nobody can call
(HF accessors such as `get_input_embeddings`) with what only they used, `self.x = ...` attributes nobody reads
(dropout rates, layer indices for HF's cache, ...), and `pass` next to real statements or alone under an
`if` without effects; attributes only `__init__` reads (`self.hidden_size` feeding layer sizes) become its
locals."""

from collections import Counter
from functools import partial

import libcst as cst
import libcst.matchers as m
from torch import nn

from skills.migrator.cst_utils import (
    SELF_ATTR,
    Transformer,
    assigned_names,
    classes,
    dotted,
    findall,
    free_names,
    in_file_bases,
    method,
    param_names,
    pure,
)
from skills.migrator.effects import computes_only, computing_functions
from skills.migrator.imports import transformers_names
from skills.migrator.rule import Rule
from skills.migrator.rules.checkpoint_branches import is_guard
from skills.migrator.rules.prune_unreachable import prune_unreachable

# A non-persistent buffer of a copy: registering it touches nothing but the module itself.
_COPY = m.Call(func=m.Attribute(attr=m.Name("clone")), args=[])
_SCRATCH_BUFFER = m.Call(
    func=m.Attribute(value=m.Name("nn"), attr=m.Name("Buffer")),
    args=[m.Arg(), m.Arg(keyword=m.Name("persistent"), value=m.Name("False"))],
)


def _removable(value: cst.BaseExpression) -> bool:
    if m.matches(value, _SCRATCH_BUFFER):
        inner = value.args[0].value
        return pure(inner) or (m.matches(inner, _COPY) and pure(inner.func.value))
    return pure(value)


def _single_assign(s: cst.BaseStatement, removable=_removable) -> cst.Assign | cst.AnnAssign | None:
    """The statement's assignment if it is one, to one target, of a value `removable` accepts."""
    if (
        isinstance(s, cst.SimpleStatementLine)
        and len(s.body) == 1
        and isinstance(s.body[0], (cst.Assign, cst.AnnAssign))
    ):
        small = s.body[0]
        targets = [t.target for t in small.targets] if isinstance(small, cst.Assign) else [small.target]
        if len(targets) == 1 and small.value is not None and removable(small.value):
            return small
    return None


def _target(small) -> cst.BaseExpression:
    return small.targets[0].target if isinstance(small, cst.Assign) else small.target


def _bound_names(target: cst.BaseExpression) -> list[str] | None:
    """The names a plain `x = ...` or `a, b, _ = ...` binds; None for any other target."""
    if isinstance(target, cst.Name):
        return [target.value]
    if isinstance(target, cst.Tuple) and all(isinstance(e.value, cst.Name) for e in target.elements):
        return [e.value.value for e in target.elements]
    return None


def _local_assignment(s: cst.BaseStatement, functions: set[str]) -> list[str] | None:
    """The names `x = <value>` (or `a, b, _ = <value>`) binds, where evaluating the value changes nothing."""
    small = _single_assign(s, lambda value: _removable(value) or computes_only(value, functions))
    return None if small is None else _bound_names(_target(small))


def _dead_names(body: cst.BaseSuite, functions: set[str]) -> set[str]:
    """Names mentioned only by such assignments of their own (`x = ...; x = x.to(dtype)` and nothing else)."""
    total: dict[str, int] = {}
    for n in findall(body, m.Name()):
        total[n.value] = total.get(n.value, 0) + 1
    own: dict[str, int] = {}
    for s in findall(body, m.SimpleStatementLine()):
        for name in _local_assignment(s, functions) or ():
            own[name] = own.get(name, 0) + sum(1 for n in findall(s, m.Name(name)))
    return {"_"} | {name for name, count in own.items() if count == total[name]}


class _DeadLocals(Transformer):
    def __init__(self, functions: set[str] = frozenset()):
        self.functions = functions  # the file's functions that only compute (their calls may go)

    def _binds_only(self, s: cst.BaseStatement, dead: set[str]) -> bool:
        names = _local_assignment(s, self.functions)
        return names is not None and set(names) <= dead

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        while True:
            dead = _dead_names(updated.body, self.functions)
            new = updated.visit(DropStatements(partial(self._binds_only, dead=dead)))
            if new.deep_equals(updated):
                return updated
            updated = new


def drop_dead_locals(fn: cst.FunctionDef) -> cst.FunctionDef:
    """fn without the locals nobody reads (for rules that remove a local's last reader)."""
    return fn.visit(_DeadLocals())


def drop_dead_locals_in(module: cst.Module, entry_class: str) -> cst.Module:
    """Every function of module without the locals nobody reads, and the top-level definitions only they
    used (a helper computing what a dropped local held)."""
    dropped = module.visit(_DeadLocals(computing_functions(module)))
    return module if dropped.deep_equals(module) else prune_unreachable(dropped, entry_class)


# `if <test>: pass` with no else (or `else: pass`), once its statements went (Falcon's `if self.use_alibi:` built
# ALiBi alone, `if is_flash_attn_available(...):` imported what nothing uses)
_PASS = m.IndentedBlock([m.SimpleStatementLine([m.Pass()])])
_EMPTY_IF = m.If(
    test=m.MatchIfTrue(computes_only),
    body=_PASS,
    orelse=m.MatchIfTrue(lambda orelse: orelse is None or m.matches(orelse, m.Else(_PASS))),
)


class DropStatements(Transformer):
    """Statements the predicate names go, with the comments above them; the next statement keeps its comments
    and takes the blank lines of the first one gone that had any, so the block reads as if they had never
    been there."""

    def __init__(self, predicate):
        self.predicate = predicate

    def leave_IndentedBlock(self, original, updated):
        body, gap = [], None  # gap: the first blank lines of the statements gone since the last one kept
        for s in updated.body:
            if m.matches(s, m.SimpleStatementLine([m.Pass()]) | _EMPTY_IF) or (
                isinstance(s, cst.SimpleStatementLine) and self.predicate(s)
            ):
                gap = gap or [line for line in s.leading_lines if line.comment is None]
                continue
            if gap is not None and body:  # its own comments stay, below the blank lines of those gone
                s = s.with_changes(leading_lines=[*gap, *(ln for ln in s.leading_lines if ln.comment)])
            body.append(s)
            gap = None
        return updated.with_changes(body=body or [cst.SimpleStatementLine([cst.Pass()])])


CONFIG = m.Name("config") | m.Attribute(value=m.Name("self"), attr=m.Name("config"))


def _family(bases: dict[str, set[str]], name: str) -> set[str]:
    """The class and its in-file bases and subclasses (bases: class -> its in-file bases), transitively: they
    share `self`."""
    family, todo = {name}, [name]
    while todo:
        n = todo.pop()
        for other in {*bases[n], *(k for k, v in bases.items() if n in v)} - family:
            family.add(other)
            todo.append(other)
    return family


def _exposes_self(cls: cst.ClassDef, hf_names: set[str]) -> bool:
    """transformers code may read any attribute: its decorator on a method (`dynamic_rope_update` reads
    `self.max_seq_len_cached`, ...) or `self` handed to one of its functions. The runtime's functions read no
    attribute, but for its `dynamic_rope_update` (MG034), which hands `self` to transformers' update."""
    for fn in findall(cls, m.FunctionDef()):
        for d in fn.decorators:
            target = dotted(d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator)
            if target.split(".")[0] in hf_names or target == "dynamic_rope_update":
                return True
    calls = findall(cls, m.Call(args=[m.ZeroOrMore(), m.Arg(value=m.Name("self")), m.ZeroOrMore()]))
    return any(dotted(c.func).split(".")[0] in hf_names for c in calls)


def _attribute_reads(module: cst.Module) -> tuple[set[int], set[str]]:
    """ids of the attribute assignment targets, and the attribute names read off anything but `self`
    (reads of the HF config's fields and import paths aside)."""
    stored = {id(t.target) for t in findall(module, m.AssignTarget(m.Attribute()))}
    code = [s for s in module.body if not m.matches(s, m.SimpleStatementLine([m.Import() | m.ImportFrom()]))]
    attrs = [a for s in code for a in findall(s, m.Attribute())]
    reads = [a for a in attrs if id(a) not in stored and not m.matches(a.value, CONFIG)]
    return stored, {a.attr.value for a in reads if not m.matches(a, SELF_ATTR)}


def unused_attrs(module: cst.Module, entry: str) -> dict[str, set[str]]:
    """Per class, the `self.x` attributes it assigns that nothing can read: not `self.x` in its family, not
    `<anything else>.x` anywhere (reads of the HF config's fields aside). The entry class keeps `config`."""
    local, hf_names = classes(module), transformers_names(module)
    stored, other_reads = _attribute_reads(module)
    self_reads = {
        name: {a.attr.value for a in findall(cls, SELF_ATTR) if id(a) not in stored}
        for name, cls in local.items()
    }
    bases = in_file_bases(local)
    unused = {}
    for name, cls in local.items():
        family = _family(bases, name)
        if any(_exposes_self(local[f], hf_names) for f in family):
            continue
        written = {t.target.attr.value for t in findall(cls, m.AssignTarget(SELF_ATTR))}
        read = other_reads.union(*(self_reads[f] for f in family))
        unused[name] = written - read - ({"config"} if name == entry else set())
    return unused


class _DropAttrs(DropStatements):
    """`self.x = <pure>` statements of the attributes unused[class] names."""

    def __init__(self, unused: dict[str, set[str]]):
        super().__init__(self._dead)
        self.unused, self.owner = unused, []

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.owner.append(node.name.value)

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        self.owner.pop()
        return updated

    def _dead(self, s: cst.BaseStatement) -> bool:
        a = _single_assign(s)
        target = _target(a) if a is not None else None
        dead = self.unused.get(self.owner[-1], set()) if self.owner else set()
        return m.matches(target, SELF_ATTR) and target.attr.value in dead


def _init_only_attrs(module: cst.Module) -> dict[str, set[str]]:
    """Per class without in-file relatives, the `self.x = <pure>` attributes only its `__init__` reads
    (`self.hidden_size` feeding nn.Linear sizes): they become locals of `__init__` where the name is free."""
    local, hf_names = classes(module), transformers_names(module)
    stored, other_reads = _attribute_reads(module)
    bases = in_file_bases(local)
    found = {}
    for name, cls in local.items():
        init = method(cls, "__init__")
        if init is None or _family(bases, name) != {name} or _exposes_self(cls, hf_names):
            continue
        elsewhere = {a.attr.value for s in cls.body.body if s is not init for a in findall(s, SELF_ATTR)}
        writes = [t.target.attr.value for t in findall(cls, m.AssignTarget(SELF_ATTR))]
        read_here = {a.attr.value for a in findall(init, SELF_ATTR) if id(a) not in stored}
        guards = [i for i in findall(init, m.If()) if is_guard(i.body)]
        quoted = {a.attr.value for g in guards for a in findall(g.test, SELF_ATTR)}  # in the message
        taken = free_names(init.body) | assigned_names(init.body) | set(param_names(init))
        single = {
            _target(a).attr.value
            for s in init.body.body
            if (a := _single_assign(s)) is not None and m.matches(_target(a), SELF_ATTR) and pure(a.value)
        }
        found[name] = {
            x
            for x in single & read_here
            if writes.count(x) == 1 and x not in elsewhere | other_reads | taken | quoted | {"config"}
        }
    return found


class _InitLocals(Transformer):
    def __init__(self, attrs: dict[str, set[str]]):
        self.attrs, self.owner = attrs, []

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.owner.append(node.name.value)

    def leave_ClassDef(self, original, updated):
        self.owner.pop()
        return updated

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.BaseExpression:
        names = self.attrs.get(self.owner[-1], set()) if self.owner else set()
        if m.matches(updated, SELF_ATTR) and updated.attr.value in names:
            return cst.Name(updated.attr.value)
        return updated


# what the runtime calls on a model's modules besides nn.Module's own methods (kept by name too)
RUNTIME_HOOKS = frozenset(
    {"forward", "load_weights", "get_cache_info", "check_model_settings", "process_weights_after_loading"}
)


def _uncalled_methods(module: cst.Module) -> dict[str, set[str]]:
    """Per class, the methods no code can call: no `<anything>.name` in the file outside the method itself (its
    `super().name(...)`, as Dory's override of a transformers resize hook calls, is no caller) and no string
    naming it, not a dunder, an nn.Module method or a runtime hook, in a class whose bases are all in the file
    or nn.Module and that hands `self` to no transformers code (which may call anything)."""
    local, hf_names = classes(module), transformers_names(module)
    named = Counter(a.attr.value for a in findall(module, m.Attribute()))
    quoted = {s.raw_value for s in findall(module, m.SimpleString())}
    bases = in_file_bases(local)

    def called(fn: cst.FunctionDef) -> bool:
        name = fn.name.value
        inside = sum(a.attr.value == name for a in findall(fn, m.Attribute()))
        return named[name] > inside or name in quoted

    found = {}
    for name, cls in local.items():
        outside = {dotted(b.value) for b in cls.bases} - local.keys() - {"nn.Module", "torch.nn.Module"}
        if outside or any(_exposes_self(local[f], hf_names) for f in _family(bases, name)):
            continue
        found[name] = {
            fn.name.value
            for fn in cls.body.body
            if isinstance(fn, cst.FunctionDef)
            and not fn.name.value.startswith("__")
            and fn.name.value not in RUNTIME_HOOKS
            and not called(fn)
            and not hasattr(nn.Module, fn.name.value)
        }
    return found


class _DropMethods(Transformer):
    def __init__(self, dead: dict[str, set[str]]):
        self.dead = dead

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        gone = self.dead.get(updated.name.value, set())
        body = [s for s in updated.body.body if not (isinstance(s, cst.FunctionDef) and s.name.value in gone)]
        if len(body) == len(updated.body.body):
            return updated
        if (
            body and body[0] is not updated.body.body[0]
        ):  # the class's first statement went: no blank line above
            body[0] = body[0].with_changes(leading_lines=[ln for ln in body[0].leading_lines if ln.comment])
        return updated.with_deep_changes(updated.body, body=body)


class DeadCode(Rule):
    ID = "MG012"
    DESCRIPTION = (
        "Locals, self attributes and methods nobody reads or calls, and pass next to real statements, go."
    )

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        module = module.with_changes(body=[s for s in module.body if not m.matches(s, _EMPTY_IF)])
        module = drop_dead_locals_in(module, self.rewrite.entry_class)
        if any((dead := _uncalled_methods(module)).values()):  # what only they used goes with them
            module = prune_unreachable(module.visit(_DropMethods(dead)), self.rewrite.entry_class)
        while True:
            new = module.visit(_DropAttrs(unused_attrs(module, self.rewrite.entry_class)))
            if new.deep_equals(module):
                break
            module = new
        init_only = _init_only_attrs(module)
        return module.visit(_InitLocals(init_only)) if any(init_only.values()) else module
