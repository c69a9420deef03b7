"""Small libcst helpers shared by the rewrite rules."""

import functools
from collections.abc import Callable, Collection, Sequence
from typing import TypeVar

import libcst as cst
import libcst.matchers as m

SELF_ATTR = m.Attribute(value=m.Name("self"))  # `self.<name>`
# `self.<name> = <call>(...)`, a statement of its own
SELF_ASSIGN_CALL = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Attribute(m.Name("self")))], m.Call())])


# Facts about a node (its children, the node classes under it), by node id: nodes are immutable, and rules walk
# the same trees many times over. An entry holds its node so that the id is not reused while the entry lives.
_HELD = 100_000  # entries per table
T = TypeVar("T")
_CHILDREN: dict[int, tuple[cst.CSTNode, tuple[cst.CSTNode, ...]]] = {}
_SUBTREE_TYPES: dict[int, tuple[cst.CSTNode, frozenset[str]]] = {}
_NAMES: dict[int, tuple[cst.CSTNode, frozenset[str]]] = {}
_CODE: dict[int, tuple[cst.CSTNode, str]] = {}


def _memo(table: dict[int, tuple[cst.CSTNode, T]], node: cst.CSTNode, make: Callable[[cst.CSTNode], T]) -> T:
    held = table.get(id(node))
    if held is None:
        value = make(node)
        if len(table) >= _HELD:
            table.clear()
        held = table[id(node)] = (node, value)
    return held[1]


def _children(node: cst.CSTNode) -> tuple[cst.CSTNode, ...]:
    return _memo(_CHILDREN, node, lambda n: tuple(n.children))


def _subtree_types(node: cst.CSTNode) -> frozenset[str]:
    """The names of the node classes in node's subtree, node's own included."""
    return _memo(
        _SUBTREE_TYPES,
        node,
        lambda n: frozenset({type(n).__name__}).union(*map(_subtree_types, _children(n))),
    )


def _node_types(matcher: m.BaseMatcherNode | m.OneOf) -> frozenset[type] | None:
    """The node classes matcher can match (LibCST's matchers first compare the class name), or None if any."""
    if isinstance(matcher, m.OneOf):
        parts = [_node_types(o) for o in matcher.options]
        return None if None in parts else frozenset().union(*parts)
    node_type = getattr(cst, type(matcher).__name__, None) if isinstance(matcher, m.BaseMatcherNode) else None
    return (
        frozenset({node_type}) if isinstance(node_type, type) and issubclass(node_type, cst.CSTNode) else None
    )


def findall(tree: cst.CSTNode | cst.MaybeSentinel | cst.RemovalSentinel, matcher) -> list[cst.CSTNode]:
    """``libcst.matchers.findall`` without metadata: tree and every node under it that matches, in the same
    (lexical, pre-) order, without rebuilding the tree to walk it."""
    if not isinstance(tree, cst.CSTNode):
        return []
    if isinstance(matcher, m.MatchIfTrue):
        matcher = m.AllOf(matcher)  # `m.matches` takes a predicate only inside another matcher
    types, found, todo = _node_types(matcher), [], [tree]
    names = None if types is None else frozenset(t.__name__ for t in types)
    while todo:
        node = todo.pop()
        if names is not None and names.isdisjoint(_subtree_types(node)):
            continue  # nothing under node can match
        if (types is None or type(node) in types) and m.matches(node, matcher):
            found.append(node)
        todo.extend(reversed(_children(node)))
    return found


_HOOKS = ("on_visit", "on_leave", "on_visit_attribute", "on_leave_attribute")
# what LibCST's matcher decorators (m.visit, m.leave, m.call_if_inside, ...) set on a method
_MATCHER_MARKS = (
    "_visit_matcher",
    "_leave_matcher",
    "_call_if_inside_matcher",
    "_call_if_not_inside_matcher",
)


@functools.cache
def _handled(transformer: type, base: type) -> frozenset[str] | None:
    """The node classes the visit_* / leave_* methods of transformer's classes below base name, or None when one
    of those overrides a generic hook or has a matcher decorator."""
    names: set[str] = set()
    for k in transformer.__mro__[: transformer.__mro__.index(base)]:
        marked = any(hasattr(f, mark) for f in vars(k).values() for mark in _MATCHER_MARKS)
        if marked or any(hook in vars(k) for hook in _HOOKS):
            return None
        names.update(a.split("_")[1] for a in vars(k) if a.startswith(("visit_", "leave_")))
    return frozenset(names)


class Transformer(cst.CSTTransformer):
    """A CSTTransformer that does not walk into a subtree holding no node its visit_* / leave_* methods name: the
    subtree comes back as it was, where a full walk would rebuild every node (a fifth of the rules' time)."""

    def on_visit(self, node: cst.CSTNode) -> bool:
        return visits_subtree(self, Transformer, node) and super().on_visit(node)


def visits_subtree(transformer: cst.CSTTransformer, base: type, node: cst.CSTNode) -> bool:
    """Whether node's subtree holds a node that the visit_* / leave_* methods of transformer below base name."""
    handled = _handled(type(transformer), base)
    return handled is None or not handled.isdisjoint(_subtree_types(node))


_EMPTY_MODULE = cst.Module([])


def code(node: cst.CSTNode) -> str:
    return _memo(_CODE, node, _EMPTY_MODULE.code_for_node)


def operand(e: cst.BaseExpression) -> str:
    """e's source, parenthesized unless it is a name, attribute, call, subscript or integer."""
    atomic = isinstance(e, cst.Name | cst.Attribute | cst.Call | cst.Integer | cst.Subscript)
    return code(e) if atomic else f"({code(e)})"


class _Substituted(Transformer):
    def __init__(self, values: dict[str, cst.BaseExpression]) -> None:
        self.values = values

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.Attribute:
        return updated.with_changes(attr=original.attr)  # `self.x`'s x is not a local

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.BaseExpression:
        value = self.values.get(original.value)
        return updated if value is None else cst.parse_expression(operand(value))


def substituted(node: cst.BaseExpression, values: dict[str, cst.BaseExpression]) -> cst.BaseExpression:
    """node with the names in values (not attribute names) replaced by their expressions, parenthesized where
    the operator around them needs it."""
    return node.visit(_Substituted(values))


def doubled(size: cst.BaseExpression) -> cst.BaseExpression | None:
    """X of a size written `2 * X` or `X * 2`."""
    if not m.matches(size, m.BinaryOperation(operator=m.Multiply())):
        return None
    if m.matches(size.left, m.Integer("2")):
        return size.right
    return size.left if m.matches(size.right, m.Integer("2")) else None


def in_file_bases(local: dict[str, cst.ClassDef]) -> dict[str, set[str]]:
    """class -> the names of its direct bases defined in the same file."""
    return {
        n: {b.value.value for b in c.bases if isinstance(b.value, cst.Name) and b.value.value in local}
        for n, c in local.items()
    }


def pure(e: cst.BaseExpression) -> bool:
    """No call, await or yield inside: evaluating it has no side effects worth keeping."""
    return not findall(e, m.Call() | m.Await() | m.Yield())


def walk(visitor: cst.CSTVisitor, node: cst.CSTNode) -> None:
    """node.visit(visitor) for a visitor that only reads: the same visit_* / leave_* calls in the same order
    (visit_<Node>_<field> hooks aside), without the copy of every node that LibCST's walk makes."""
    if visitor.on_visit(node):
        for child in _children(node):
            walk(visitor, child)
    visitor.on_leave(node)


def names_in(node: cst.CSTNode) -> frozenset[str]:
    """Every bare Name referenced (or bound) anywhere under node."""
    if isinstance(node, cst.Name):
        return frozenset({node.value})
    return _memo(_NAMES, node, lambda n: frozenset().union(*map(names_in, _children(n))))


SHAPE_READS = frozenset({"shape", "dtype", "device", "ndim", "size", "dim"})


def free_names(node: cst.CSTNode, skipped: Collection[int] = (), data_only: bool = False) -> set[str]:
    """Bare names read under node: attribute names, keyword names and the Name nodes whose ids are skipped
    excluded. data_only: names whose values flow into node; `x.shape`, `x.size(-1)`, `x.dtype` read none of x."""
    found: set[str] = set()

    class _Collect(cst.CSTVisitor):
        def visit_Name(self, n: cst.Name) -> None:
            if id(n) not in skipped:
                found.add(n.value)

        def visit_Attribute(self, n: cst.Attribute) -> bool:
            if not (data_only and n.attr.value in SHAPE_READS):
                walk(self, n.value)
            return False

        def visit_Arg(self, n: cst.Arg) -> bool:
            walk(self, n.value)
            return False

    walk(_Collect(), node)
    return found


def assigned_names(stmt: cst.CSTNode) -> set[str]:
    """Names bound by assignments (incl. walrus, augmented, subscript/attribute bases) under stmt."""
    found: set[str] = set()

    def base(target: cst.BaseExpression) -> None:
        while isinstance(target, (cst.Subscript, cst.Attribute)):
            target = target.value
        if isinstance(target, cst.Name):
            found.add(target.value)
        elif isinstance(target, (cst.Tuple, cst.List)):
            for el in target.elements:
                base(el.value)

    class _Collect(cst.CSTVisitor):
        def visit_AssignTarget(self, n: cst.AssignTarget) -> None:
            base(n.target)

        def visit_AnnAssign(self, n: cst.AnnAssign) -> None:
            base(n.target)

        def visit_AugAssign(self, n: cst.AugAssign) -> None:
            base(n.target)

        def visit_NamedExpr(self, n: cst.NamedExpr) -> None:
            base(n.target)

        def visit_For(self, n: cst.For) -> None:
            base(n.target)

    walk(_Collect(), stmt)
    return found


def _rebound(stmt: cst.CSTNode) -> set[int]:
    """ids of the Name nodes under stmt that only rebind a name: `x = ...` / `a, b = ...` targets, loop targets."""
    found: set[int] = set()

    def plain(target: cst.BaseExpression) -> None:
        if isinstance(target, cst.Name):
            found.add(id(target))
        elif isinstance(target, (cst.Tuple, cst.List)):
            for el in target.elements:
                plain(el.value)

    for node in findall(stmt, m.AssignTarget() | m.For()):
        plain(node.target)
    return found


def read_names(stmt: cst.CSTNode) -> set[str]:
    """Names stmt reads; rebinding a name is not reading it."""
    return free_names(stmt, _rebound(stmt))


def dotted(expr: cst.BaseExpression) -> str:
    """`a.b.c` for Name/Attribute chains, '' otherwise."""
    if isinstance(expr, cst.Name):
        return expr.value
    if isinstance(expr, cst.Attribute):
        head = dotted(expr.value)
        return f"{head}.{expr.attr.value}" if head else ""
    return ""


def called_name(call: cst.Call) -> str:
    return dotted(call.func)


def without_dangling_comma(kept: list, before: Sequence) -> list:
    """kept (some of the arguments or parameters `before`, in order) with no comma left dangling after the last
    one where `before` had none: `f(x, )` -> `f(x)`."""
    if kept and len(kept) < len(before) and before[-1].comma is cst.MaybeSentinel.DEFAULT:
        kept = [*kept[:-1], kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)]
    return kept


def with_args(call: cst.Call, args: list[cst.Arg]) -> cst.Call:
    """call with args (some of its own, some dropped) and no comma left dangling."""
    return call.with_changes(args=without_dangling_comma(args, call.args))


def kwarg(call: cst.Call, name: str) -> cst.Arg | None:
    return next((a for a in call.args if a.keyword and a.keyword.value == name), None)


def stmts(code: str) -> list[cst.BaseStatement]:
    return list(cst.parse_module(code).body)


def stmt(code: str) -> cst.BaseStatement:
    (s,) = stmts(code)
    return s


def is_docstring(s: cst.BaseStatement) -> bool:
    """s is a docstring statement (a string literal on its own line)."""
    return m.matches(s, m.SimpleStatementLine([m.Expr(m.SimpleString() | m.ConcatenatedString())]))


def classes(module: cst.Module) -> dict[str, cst.ClassDef]:
    return {s.name.value: s for s in module.body if isinstance(s, cst.ClassDef)}


def method(cls: cst.ClassDef, name: str) -> cst.FunctionDef | None:
    return next((s for s in cls.body.body if isinstance(s, cst.FunctionDef) and s.name.value == name), None)


def with_method(cls: cst.ClassDef, old: cst.FunctionDef, new: cst.FunctionDef) -> cst.ClassDef:
    """cls with its method old replaced by new."""
    return cls.with_changes(body=cls.body.with_changes(body=[new if s is old else s for s in cls.body.body]))


def param_names(fn: cst.FunctionDef) -> list[str]:
    p = fn.params
    return [x.name.value for x in (*p.posonly_params, *p.params, *p.kwonly_params)]


def attention_layer(init: cst.FunctionDef) -> tuple[str, cst.SimpleStatementLine] | None:
    """(attr, line) of the one top-level `self.<attr> = Attention(...)` of init."""
    lines = [
        s
        for s in init.body.body
        if m.matches(s, SELF_ASSIGN_CALL) and called_name(s.body[0].value) == "Attention"
    ]
    return (lines[0].body[0].targets[0].target.attr.value, lines[0]) if len(lines) == 1 else None


def appended(call: cst.Call, name: str, value: str) -> cst.Call:
    """call with `name=value` last but for a trailing `**mapping`, laid out like its other arguments (one per line
    stays one per line)."""
    new = cst.parse_expression(f"f({name}={value})").args[0]
    if not call.args:
        return call.with_changes(args=[new])
    *rest, last = call.args
    between = rest[-1].comma if rest else cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    if last.star == "**":
        return call.with_changes(args=[*rest, new.with_changes(comma=between), last])
    return call.with_changes(
        args=[*rest, last.with_changes(comma=between), new.with_changes(comma=last.comma)]
    )


def with_attention_kwarg(
    cls: cst.ClassDef,
    attn_line: cst.SimpleStatementLine,
    name: str,
    value: str,
    fwd: cst.FunctionDef,
    new_fwd: cst.FunctionDef,
) -> cst.ClassDef:
    """cls with `name=value` added to its `self.<attr> = Attention(...)` line (in __init__) and fwd replaced."""
    init = method(cls, "__init__")
    layer_call = attn_line.body[0].value
    new_layer = attn_line.deep_replace(layer_call, appended(layer_call, name, value))
    new = {id(init): init.deep_replace(attn_line, new_layer), id(fwd): new_fwd}
    return cls.with_changes(body=cls.body.with_changes(body=[new.get(id(s), s) for s in cls.body.body]))


def rewrite_classes(module: cst.Module, rewrite: Callable[[cst.ClassDef], cst.ClassDef | None]) -> cst.Module:
    """module with each top-level class that rewrite changes (returns not None) replaced."""
    new = {name: out for name, cls in classes(module).items() if (out := rewrite(cls)) is not None}
    if not new:
        return module
    return module.with_changes(
        body=[new.get(s.name.value, s) if isinstance(s, cst.ClassDef) else s for s in module.body]
    )


def class_choice(names: set[str], tables: set[str] = frozenset()) -> m.Assign:
    """`cls = A if c else B` (or `else None`, Bamba's MLP where there are no experts), `cls = TABLE[kind]`: a local
    name holding one of the classes `names`, or of a module-level table of them (`tables`), to be called later."""
    held = m.OneOf(*map(m.Name, names))
    chosen = m.IfExp(body=held, orelse=held | m.Name("None"))
    if tables:
        chosen |= m.Subscript(value=m.OneOf(*map(m.Name, tables)))
    return m.Assign(targets=[m.AssignTarget(m.Name())], value=chosen)


def class_tables(module: cst.Module, names: set[str]) -> dict[str, cst.Dict]:
    """Module-level `TABLE = {"mamba": A, "attention": B}` whose values are all of the classes `names`, by name
    (Nemotron-H's mixers, Jamba's decoder layers, picked per layer by kind)."""
    held = m.OneOf(*map(m.Name, names))
    table = m.Dict([m.AtLeastN(m.DictElement(value=held), n=1)])
    return {
        s.body[0].targets[0].target.value: s.body[0].value
        for s in module.body
        if m.matches(s, m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name())], table)]))
    }


def choices(e: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The values e may take: the branches of conditionals (`A(...) if c else b`), else e itself."""
    return choices(e.body) + choices(e.orelse) if isinstance(e, cst.IfExp) else [e]


def members(table: cst.Dict) -> set[str]:
    """The names of the classes a table of classes holds."""
    return {e.value.value for e in table.elements}


def class_table_members(module: cst.Module, names: set[str]) -> dict[str, set[str]]:
    """class_tables(module, names) as the classes each table holds."""
    return {n: members(t) for n, t in class_tables(module, names).items()}


class _KwargsKeepMetadata(cst.CSTTransformer):
    """Calls that pass the `**` parameter on (the module's own layers, `self.<attr>(...)`, or one a loop over them
    names: Inkling2's `for decoder_layer in self.layers`, Inkling2-Loop's `for i, decoder_layer in
    enumerate(self.layers[a:b])`) pass forward_metadata too, now that it is a parameter of its own."""

    def __init__(self, star: str, fn: cst.FunctionDef):
        self.star = star
        held = m.Attribute(m.Name("self")) | m.Subscript(value=m.Attribute(m.Name("self")))
        plain = findall(fn.body, m.For(target=m.Name(), iter=held))
        counted = m.For(
            target=m.Tuple([m.Element(m.Name()), m.Element(m.Name())]),
            iter=m.Call(m.Name("enumerate"), [m.Arg(held)]),
        )
        names = [f.target.value for f in plain]
        names += [f.target.elements[1].value.value for f in findall(fn.body, counted)]
        self.callee = m.OneOf(m.Attribute(m.Name("self")), *map(m.Name, names))

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if not m.matches(updated.func, self.callee):
            return updated
        if not any(a.star == "**" and m.matches(a.value, m.Name(self.star)) for a in updated.args):
            return updated
        if any(a.keyword and a.keyword.value == "forward_metadata" for a in updated.args):
            return updated
        return appended(updated, "forward_metadata", "forward_metadata")


def with_forward_metadata(fn: cst.FunctionDef) -> cst.FunctionDef:
    """fn taking a keyword-only `forward_metadata: ForwardMetaData` (unchanged if it takes one). Its calls that
    pass its `**` parameter on, which held forward_metadata until now, pass it by name (ZAYA's attention hands
    `**kwargs` to a projection that runs per request)."""
    if "forward_metadata" in param_names(fn):
        return fn
    param = cst.Param(cst.Name("forward_metadata"), cst.Annotation(cst.Name("ForwardMetaData")))
    star = fn.params.star_arg if isinstance(fn.params.star_arg, cst.Param) else cst.ParamStar()
    if isinstance(fn.params.star_kwarg, cst.Param):
        fn = fn.with_changes(body=fn.body.visit(_KwargsKeepMetadata(fn.params.star_kwarg.name.value, fn)))
    return fn.with_changes(
        params=fn.params.with_changes(star_arg=star, kwonly_params=[*fn.params.kwonly_params, param])
    )


class KwargsPassing(cst.CSTTransformer):
    """Base of the transformers that make some calls pass their caller's `**` parameter on (`with_kwargs`): that of
    the innermost enclosing function that has one (a nested def reads its enclosing one's), else `**kwargs`, which
    the calling function then takes. Subclasses that define visit_FunctionDef / leave_FunctionDef call these."""

    def __init__(self) -> None:
        self.stars: list[str | None] = []  # per enclosing function: the name of its `**` parameter
        self.needs_kwargs: list[bool] = []  # per enclosing function: a call passes the `**kwargs` it lacks

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        star = node.params.star_kwarg
        self.stars.append(star.name.value if isinstance(star, cst.Param) else None)
        self.needs_kwargs.append(False)

    def with_kwargs(self, call: cst.Call) -> cst.Call:
        star = next((s for s in reversed(self.stars) if s), None)
        self.needs_kwargs[-1] |= star is None
        return call.with_changes(args=[*call.args, cst.Arg(cst.Name(star or "kwargs"), star="**")])

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        self.stars.pop()
        if self.needs_kwargs.pop():
            updated = updated.with_changes(
                params=updated.params.with_changes(star_kwarg=cst.Param(cst.Name("kwargs")))
            )
        return updated
