"""Branches the checkpoint never takes go, when they only keep transformers machinery alive: an `if` whose
test reads nothing but the checkpoint's config (`config.x`, `self.config.x[...]`, `self.a` set once from
them) is evaluated on that config; when it is false and its body uses a name imported from transformers
(`ROPE_INIT_FUNCTIONS[...]` for a RoPE type the checkpoint does not have) or reads a layer's weight itself
instead of calling the layer (BLOOM's `pretraining_tp` slices of `self.dense.weight`, which no parallel or
quantized layer could honour), the body becomes a NotImplementedError naming the test, so the same code given
another checkpoint refuses instead of computing something else. `@dynamic_rope_update` goes from a class whose
RoPE type is pinned that way to a non-dynamic one (the decorator does nothing for those types), and with it the
attributes only it read."""

from collections.abc import Callable
from types import SimpleNamespace

import libcst as cst
import libcst.matchers as m
from transformers import PretrainedConfig

from skills.migrator.call_sites import binding, call_sites
from skills.migrator.cst_utils import (
    SELF_ATTR,
    Transformer,
    assigned_names,
    classes,
    dotted,
    findall,
    method,
    names_in,
    rewrite_classes,
)
from skills.migrator.imports import transformers_names
from skills.migrator.rule import Rule

BUILTINS = {"getattr": getattr, "len": len}
# The RoPE types transformers' dynamic_rope_update acts on ("dynamic" in the type, or "longrope").
DYNAMIC_ROPE = ("dynamic", "longrope")
LAYER_WEIGHT = m.Attribute(m.Attribute(m.Name("self"), m.Name()), m.Name("weight") | m.Name("bias"))
GUARD = ("migrated for a checkpoint where `{test}` is {value}; ", "run `skill migrate` on this checkpoint")
GuardText = tuple[str, str]
SUPER_INIT_CONFIG = m.Call(
    m.Attribute(m.Call(m.Name("super")), m.Name("__init__")), [m.Arg(m.Name("config"))]
)


def _config_only(e: cst.BaseExpression, allowed: set[str]) -> bool:
    """e reads only the names in allowed, literals, and getattr / len: no other call, no side effect."""
    calls = findall(e, m.Call())
    if any(not m.matches(c.func, m.Name("getattr") | m.Name("len")) for c in calls):
        return False
    attributes = {a.attr.value for a in findall(e, m.Attribute())}
    free = names_in(e) - {"getattr", "len", "True", "False", "None"} - attributes
    return not findall(e, m.Lambda() | m.Await() | m.Yield() | m.NamedExpr()) and free <= allowed


def _evaluate(e: cst.BaseExpression, scope: dict) -> tuple[bool, object]:
    try:
        return True, eval(cst.Module([]).code_for_node(e), {"__builtins__": BUILTINS}, dict(scope))
    except (AttributeError, KeyError, IndexError, TypeError, ValueError, NameError):
        return False, None  # a field this config does not have, a type it cannot compare...: undecidable


def _self_attrs(cls: cst.ClassDef, init: cst.FunctionDef, config: PretrainedConfig) -> SimpleNamespace:
    """`self.a = <expr of config>` in __init__, for the attributes the class assigns exactly once, and
    `self.config` of a class whose `super().__init__(config)` is PreTrainedModel's (before MG008 spells it out)."""
    targets = [t.target.attr.value for t in findall(cls, m.AssignTarget(SELF_ATTR))]
    targets += [a.target.attr.value for a in findall(cls, m.AugAssign(target=SELF_ATTR))]
    ns = SimpleNamespace()
    if "config" not in targets and findall(init.body, SUPER_INIT_CONFIG):
        ns.config = config
    for a in findall(init.body, m.Assign(targets=[m.AssignTarget(SELF_ATTR)])):
        name = a.targets[0].target.attr.value
        if targets.count(name) == 1 and _config_only(a.value, {"config", "self"}):
            ok, value = _evaluate(a.value, {"config": config, "self": ns})
            if ok:
                setattr(ns, name, value)
    return ns


def checkpoint_value(
    cls: cst.ClassDef, e: cst.BaseExpression, config: PretrainedConfig | None
) -> tuple[bool, object]:
    """(whether it could be, the value of) e, an expression of the checkpoint's config and of attributes __init__
    sets once from it, as __init__ computes it for this checkpoint."""
    init = method(cls, "__init__")
    if config is None or init is None or not _config_only(e, {"config", "self"}):
        return False, None
    return _evaluate(e, {"config": config, "self": _self_attrs(cls, init, config)})


def _config_classes(module: cst.Module, config: PretrainedConfig) -> set[str]:
    """The classes whose __init__ takes the checkpoint's config as `config` and never rebinds it: annotated
    `config: <its class>`, or unannotated and built only by such classes, each passing its own `config`
    (GPT-BigCode's attention, built `GPTBigCodeAttention(config, ...)` by its block)."""
    local, sites = classes(module), call_sites(module)
    inits = {name: init for name, cls in local.items() if (init := method(cls, "__init__")) is not None}
    params = {}
    for name, init in inits.items():
        param = next((p for p in init.params.params if p.name.value == "config"), None)
        if param is not None and "config" not in assigned_names(init.body):
            params[name] = param
    found = {
        name
        for name, p in params.items()
        if p.annotation and dotted(p.annotation.annotation).split(".")[-1] == type(config).__name__
    }
    # each constructor call -> the class whose __init__ makes it
    owner = {id(c): name for name, init in inits.items() for c in findall(init, m.Call())}
    candidates = {}  # unannotated: the builders of those built only with `config`
    for name, param in params.items():
        where = sites[name]
        if param.annotation or where.name_escapes or not where.constructed:
            continue
        passed = [binding(c, inits[name], param) for c in where.constructed]
        if all(a is not None and m.matches(a.value, m.Name("config")) for a in passed):
            candidates[name] = {owner.get(id(c)) for c in where.constructed}
    while grown := {n for n, builders in candidates.items() if n not in found and builders <= found}:
        found |= grown
    return found


def _guard(test: cst.BaseExpression, text: GuardText, value: str = "false") -> cst.BaseStatement:
    """`raise NotImplementedError(...)` naming the checkpoint's value of test."""
    shown = cst.Module([]).code_for_node(test)
    what, how = (cst.SimpleString(repr(part.format(test=shown, value=value))) for part in text)
    message = cst.ConcatenatedString(
        what,
        how,
        whitespace_between=cst.ParenthesizedWhitespace(indent=True, last_line=cst.SimpleWhitespace("    ")),
    )
    return cst.SimpleStatementLine([cst.Raise(cst.Call(cst.Name("NotImplementedError"), [cst.Arg(message)]))])


def is_guard(body: cst.BaseSuite) -> bool:
    """body is one `raise` (a guard MG018 writes, or the file's own)."""
    return m.matches(body, m.IndentedBlock([m.SimpleStatementLine([m.Raise()])]))


def _reads_layer_weight(body: cst.BaseSuite) -> bool:
    """body reads `self.<layer>.weight` (or `.bias`) itself; assigning it (a weight tie) is no read."""
    written = {id(t.target) for t in findall(body, m.AssignTarget(LAYER_WEIGHT))}
    return any(id(a) not in written for a in findall(body, LAYER_WEIGHT))


Wanted = Callable[[cst.ClassDef, cst.If], bool]


def keeps_transformers_alive(hf_names: set[str]) -> Wanted:
    """MG018's branches: those whose body uses a name imported from transformers or reads a layer's weight."""
    return lambda cls, branch: bool(names_in(branch.body) & hf_names) or _reads_layer_weight(branch.body)


class _Fold(Transformer):
    """In one class: the untaken config branches `wanted` picks become guards."""

    def __init__(
        self, cls: cst.ClassDef, scopes: dict[str, dict], wanted: Wanted, text: GuardText, elses: bool
    ) -> None:
        self.cls, self.scopes, self.wanted, self.text, self.function = cls, scopes, wanted, text, []
        self.elses = elses  # also an untaken `else:` after a taken test
        self.elifs: set[int] = set()  # an `elif` is its parent's orelse: it cannot become several statements

    def visit_If(self, node: cst.If) -> None:
        if isinstance(node.orelse, cst.If):
            self.elifs.add(id(node.orelse))

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.function.append(node.name.value)

    def leave_FunctionDef(self, original, updated):
        self.function.pop()
        return updated

    def leave_If(self, original: cst.If, updated: cst.If):
        scope = self.scopes.get(self.function[0]) if len(self.function) == 1 else None
        if scope is None or is_guard(updated.body) or not _config_only(updated.test, set(scope)):
            return updated
        ok, value = _evaluate(updated.test, scope)
        if ok and value and self.elses and updated.orelse is not None:
            return self._guard_else(original, updated)
        if not ok or value or not self.wanted(self.cls, original):
            return updated
        guarded = cst.IndentedBlock([_guard(updated.test, self.text)])
        if id(original) in self.elifs:  # `elif <test>: raise ...`, the rest of the chain after it as it was
            return updated.with_changes(body=guarded)
        guard = updated.with_changes(body=guarded, orelse=None)
        rest = updated.orelse
        if isinstance(rest, cst.Else):
            return cst.FlattenSentinel([guard, *rest.body.body])
        if isinstance(rest, cst.If):  # the `elif` now starts a chain of its own, taken or not like any `if`
            ok, value = _evaluate(rest.test, scope)
            taken = ok and value and self.elses and rest.orelse is not None and not is_guard(rest.body)
            after = self._guard_else(rest, rest, standalone=True) if taken else rest
            if isinstance(after, cst.If) and is_guard(after.body) and isinstance(after.orelse, cst.Else):
                after = cst.FlattenSentinel([after.with_changes(orelse=None), *after.orelse.body.body])
            return cst.FlattenSentinel(
                [guard, *(after.nodes if isinstance(after, cst.FlattenSentinel) else [after])]
            )
        return guard

    def _guard_else(self, original: cst.If, updated: cst.If, standalone: bool = False):
        """`if <test>: A else: B` (or `elif ...`), test true and what follows A wanted: `if not <test>: raise ...`
        then A. An `elif` is left as it is unless it now stands alone (its chain's earlier tests guarded)."""
        rest = original.orelse
        untaken = original.with_changes(
            body=rest.body if isinstance(rest, cst.Else) else cst.IndentedBlock([rest]), orelse=None
        )
        if (id(original) in self.elifs and not standalone) or not self.wanted(self.cls, untaken):
            return updated
        test = updated.test
        if m.matches(test, m.UnaryOperation(m.Not())):  # `if not x: A else: B`: `if x: raise ...`
            negated = test.expression.with_changes(lpar=[], rpar=[])
            raised = _guard(negated, self.text)
        else:
            if not isinstance(test, (cst.Name, cst.Attribute, cst.Call, cst.Subscript)):
                test = test.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
            negated = cst.UnaryOperation(cst.Not(), test)
            raised = _guard(test.with_changes(lpar=[], rpar=[]), self.text, "true")
        guard = updated.with_changes(test=negated, body=cst.IndentedBlock([raised]), orelse=None)
        return cst.FlattenSentinel([guard, *updated.body.body])


def _pins_rope_type(cls: cst.ClassDef) -> bool:
    """A guard of the class refuses every RoPE type but one the decorator does nothing for: `if
    <...>.rope_type != "default": raise ...`."""
    pin = m.Comparison(
        left=m.Attribute(attr=m.Name("rope_type")),
        comparisons=[m.ComparisonTarget(m.NotEqual(), m.SimpleString())],
    )
    pinned = [i.test for i in findall(cls, m.If()) if is_guard(i.body) and m.matches(i.test, pin)]
    return any(
        not any(d in t.comparisons[0].comparator.evaluated_value for d in DYNAMIC_ROPE) for t in pinned
    )


def _drop_rope_update(cls: cst.ClassDef, hf_names: set[str]) -> cst.ClassDef:
    def strip(fn: cst.FunctionDef) -> cst.FunctionDef:
        kept = [
            d
            for d in fn.decorators
            if not (dotted(d.decorator) == "dynamic_rope_update" and "dynamic_rope_update" in hf_names)
        ]
        return fn.with_changes(decorators=kept)

    body = [strip(s) if isinstance(s, cst.FunctionDef) else s for s in cls.body.body]
    return cls.with_changes(body=cls.body.with_changes(body=body))


def guard_untaken_branches(
    module: cst.Module,
    config: PretrainedConfig | None,
    wanted: Wanted,
    text: GuardText = GUARD,
    then: Callable[[cst.ClassDef], cst.ClassDef] = lambda cls: cls,
    elses: bool = False,
) -> cst.Module:
    """module with the untaken config branches of each class built from config that `wanted` picks turned into
    guards (elses: an `else:` after a test the config makes true too), `then` applied to each such class after.
    Without a config (no checkpoint), module as it is."""
    if config is None:
        return module
    built_from_config = _config_classes(module, config)

    def fold(cls: cst.ClassDef) -> cst.ClassDef | None:
        init = method(cls, "__init__")
        if init is None or cls.name.value not in built_from_config:
            return None
        attrs = _self_attrs(cls, init, config)
        methods = [s for s in cls.body.body if isinstance(s, cst.FunctionDef)]
        scopes = {fn.name.value: {"self": attrs} for fn in methods}
        scopes["__init__"] = {"self": attrs, "config": config}
        new = then(cls.visit(_Fold(cls, scopes, wanted, text, elses)))
        return None if new.deep_equals(cls) else new

    return rewrite_classes(module, fold)


class CheckpointBranches(Rule):
    ID = "MG018"
    DESCRIPTION = (
        "Untaken config branches that keep transformers code alive or read a layer's weight become guards."
    )

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        hf_names = transformers_names(module)

        def unpin(cls: cst.ClassDef) -> cst.ClassDef:
            return _drop_rope_update(cls, hf_names) if _pins_rope_type(cls) else cls

        config = self.rewrite.checkpoint_config
        return guard_untaken_branches(module, config, keeps_transformers_alive(hf_names), then=unpin)
