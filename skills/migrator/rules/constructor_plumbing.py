"""Constructors of every in-file module that holds weights (layers, or parameters stacked per expert), whether
built from the config or from plain sizes (XGLM's `XGLMAttention(embed_dim, num_heads)`), take the runtime
contract `(..., infer_config, comm_manager, prefix)` and pass it down, with `prefix` naming the child's path."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.call_sites import MODULE_LIST, builders
from skills.migrator.cst_utils import (
    SELF_ATTR,
    Transformer,
    called_name,
    choices,
    class_choice,
    class_table_members,
    class_tables,
    classes,
    findall,
    members,
    method,
    param_names,
)
from skills.migrator.expert_params import expert_params
from skills.migrator.rule import Rule

WEIGHTED = {"nn.Linear", "Linear", "Conv1D", "Attention", "nn.Embedding", "Embedding"}


def _built(fns: list[cst.FunctionDef], tables: dict[str, set[str]]) -> set[str]:
    """The classes the functions construct: called by name, or any class of a table they index (`TABLE[kind](...)`,
    or `cls = TABLE[kind]` and then `cls(...)`)."""
    callees = {called_name(c) for fn in fns for c in findall(fn, m.Call())}
    indexed = m.Subscript(value=m.OneOf(*map(m.Name, tables or {""})))
    for c in (c for fn in fns for c in findall(fn, indexed)):
        callees |= tables[c.value.value]
    return callees


def plumbed_classes(module: cst.Module, entry: str) -> set[str]:
    local = classes(module)
    tables = class_table_members(module, set(local))
    tables |= {n: members(t) for n, t in _local_tables(module, set(local)).items()}
    plumbed = {entry}
    while True:
        grown = set(plumbed)
        for name, cls in local.items():
            init = method(cls, "__init__")
            if init is None:
                continue
            if _built([init, *builders(cls).values()], tables) & (WEIGHTED | plumbed) or expert_params(init):
                grown.add(name)
        if grown == plumbed:
            return plumbed
        plumbed = grown


def _new_params(init: cst.FunctionDef) -> cst.Parameters:
    params = init.params
    defaulted = any(p.default is not None for p in params.params)
    add = [
        cst.Param(
            cst.Name("infer_config"),
            cst.Annotation(cst.Name("InferenceConfig")),
            default=cst.Name("None") if defaulted else None,
        ),
        cst.Param(
            cst.Name("comm_manager"),
            cst.Annotation(cst.parse_expression("CommManager | None")),
            default=cst.Name("None"),
        ),
        cst.Param(cst.Name("prefix"), cst.Annotation(cst.Name("str")), default=cst.SimpleString('""')),
    ]
    return params.with_changes(params=[*params.params, *add])


class _PassDown(Transformer):
    """Adds the contract kwargs to constructor calls of plumbed classes inside one __init__."""

    def __init__(self, plumbed: set[str], tables: set[str], returned_to: str = ""):
        self.plumbed, self.tables = plumbed, tables
        self.returned_to = returned_to  # a builder's: the attribute its caller assigns the result to
        self.path: list[str] = []  # attribute being assigned, then comprehension loop variables
        self.loop_vars: list[str] = []  # enclosing `for` targets
        # local -> the list attribute it ends in (`self.layers = nn.ModuleList(x)`)
        self.held: dict[str, str] = {}

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        held = m.Assign([m.AssignTarget(SELF_ATTR)], MODULE_LIST)
        self.held = {a.value.args[0].value.value: a.targets[0].target.attr.value for a in findall(node, held)}
        # a builder's `return nn.ModuleList(x)`
        for r in findall(node, m.Return(MODULE_LIST)) if self.returned_to else ():
            self.held[r.value.args[0].value.value] = self.returned_to
        append = m.Call(m.Attribute(m.Name(), m.Name("append")), [m.Arg()])
        for c in findall(node, append):  # `mamba = Layer(...)`, later `layers.append(mamba)`
            if (attr := self.held.get(c.func.value.value)) is not None:
                for item in choices(c.args[0].value):
                    if isinstance(item, cst.Name):
                        self.held.setdefault(item.value, attr)

    def visit_Assign(self, node: cst.Assign) -> None:
        target = node.targets[0].target
        self.path = [target.attr.value] if m.matches(target, m.Attribute(value=m.Name("self"))) else []
        if isinstance(target, cst.Name) and target.value in self.held:
            self.path = self._in_list(target.value)
        # `cls = A if c else B`, `cls = TABLE[kind]`: calls of cls are plumbed too
        if m.matches(node, class_choice(self.plumbed, self.tables)):
            self.plumbed = self.plumbed | {target.value}

    def visit_For(self, node: cst.For) -> None:
        target = node.target
        if m.matches(
            node, m.For(m.Tuple([m.Element(m.Name()), m.ZeroOrMore()]), m.Call(m.Name("enumerate")))
        ):
            target = target.elements[0].value  # `for i, kind in enumerate(...)`: the index
        self.loop_vars.append(target.value if isinstance(target, cst.Name) else "")

    def leave_For(self, original, updated):
        self.loop_vars.pop()
        return updated

    def visit_Call(self, node: cst.Call) -> None:
        """`self.layers.append(Layer(...))` inside `for i in ...`: the child is `layers.{i}`."""
        if m.matches(node.func, m.Attribute(value=m.Attribute(value=m.Name("self")), attr=m.Name("append"))):
            self.path = [node.func.value.attr.value, *("{" + v + "}" for v in self.loop_vars if v)]
        elif (
            m.matches(node.func, m.Attribute(m.Name(), m.Name("append")))
            and node.func.value.value in self.held
        ):
            self.path = self._in_list(
                node.func.value.value
            )  # `layers.append(...)`, then `nn.ModuleList(layers)`

    def _in_list(self, local: str) -> list[str]:
        return [self.held[local], *("{" + v + "}" for v in self.loop_vars if v)]

    def visit_ListComp(self, node: cst.ListComp) -> None:
        self._loop_vars(node.for_in)

    def visit_GeneratorExp(self, node: cst.GeneratorExp) -> None:
        self._loop_vars(node.for_in)

    def _loop_vars(self, comp: cst.CompFor | None) -> None:
        while comp is not None:
            if isinstance(comp.target, cst.Name):
                self.path.append("{" + comp.target.value + "}")
            comp = comp.inner_for_in

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        tabled = m.matches(updated.func, m.Subscript(value=m.OneOf(*map(m.Name, self.tables or {""}))))
        if not (tabled or called_name(updated) in self.plumbed) or any(
            a.keyword and a.keyword.value == "prefix" for a in updated.args
        ):
            return updated
        child = ".".join(self.path) or (tabled and "layer") or called_name(updated).lower()
        fmt = "f" if "{" in child else ""
        extra = cst.parse_expression(
            f"f(infer_config=infer_config, comm_manager=comm_manager, "
            f'prefix=join_prefix(prefix, {fmt}"{child}"))'
        ).args
        args = list(updated.args)
        if args:
            args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        return updated.with_changes(args=[*args, *extra])


class _Plumb(Transformer):
    def __init__(self, plumbed: set[str], tables: dict[str, set[str]]):
        self.plumbed, self.tables = plumbed, tables

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        init = method(updated, "__init__")
        if updated.name.value not in self.plumbed or init is None or "infer_config" in param_names(init):
            return updated
        builds = self.plumbed | WEIGHTED
        helpers = {n: f for n, f in builders(updated).items() if _built([f], self.tables) & builds}
        new_init = init.with_changes(params=_new_params(init)).visit(
            _PassDown(self.plumbed, set(self.tables))
        )
        new_init = new_init.visit(_PassContract(set(helpers)))
        done = {id(init): new_init}
        for name, fn in helpers.items():
            assigned = m.Assign(
                [m.AssignTarget(SELF_ATTR)], m.Call(m.Attribute(m.Name("self"), m.Name(name)))
            )
            attrs = [a.targets[0].target.attr.value for a in findall(init, assigned)]
            down = _PassDown(self.plumbed, set(self.tables), attrs[0] if len(attrs) == 1 else "")
            done[id(fn)] = fn.with_changes(params=_new_params(fn)).visit(down)
        body = [done.get(id(s), s) for s in updated.body.body]
        return updated.with_changes(body=updated.body.with_changes(body=body))


class _PassContract(Transformer):
    """`self.<builder>(...)` calls in __init__ pass the contract on, prefix unchanged: the builder's children are
    the class's own."""

    def __init__(self, helpers: set[str]):
        self.helpers = helpers

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if not m.matches(updated.func, SELF_ATTR) or updated.func.attr.value not in self.helpers:
            return updated
        extra = cst.parse_expression("f(infer_config=infer_config, comm_manager=comm_manager, prefix=prefix)")
        return updated.with_changes(args=[*updated.args, *extra.args])


def _aliased(
    module: cst.Module, plumbed: set[str], tables: dict[str, cst.Dict]
) -> list[tuple[str, cst.Name]]:
    """(scope, name) where a plumbed class is held as a value to be called later other than as a `class_choice` in
    a constructor or in a module-level table of plumbed classes (which _PassDown plumbs): `cls = A if c else
    NotPlumbed`, `{"x": A, "y": NotPlumbed}[kind](...)`."""
    held = m.OneOf(*map(m.Name, plumbed))
    alias = m.Assign(value=held) | m.IfExp(body=held) | m.IfExp(orelse=held) | m.DictElement(value=held)
    scopes = [(name, cls) for name, cls in classes(module).items()]
    scopes += [("<module>", s) for s in module.body if not isinstance(s, cst.ClassDef)]
    inits = [init for cls in classes(module).values() if (init := method(cls, "__init__")) is not None]
    chosen = {id(a.value) for init in inits for a in findall(init, class_choice(plumbed, set(tables)))}
    chosen |= {id(e) for table in tables.values() for e in table.elements}
    found = []
    for scope, node in scopes:
        for a in findall(node, alias):
            if id(a) in chosen:
                continue
            value = a.value if isinstance(a, (cst.Assign, cst.DictElement)) else None
            found += [(scope, n) for n in ([value] if value else [a.body, a.orelse]) if m.matches(n, held)]
    return found


def _built_from(module: cst.Module, table: str, plumbed: set[str]) -> bool:
    """Every use of the module-level `table` is in a constructor of a plumbed class, a `table[kind](...)` call or a
    `cls = table[kind]` choice (there is at least one)."""
    name = m.Name(table)
    uses = len(findall(module, name)) - 1  # but its assignment
    inits = [init for n, c in classes(module).items() if n in plumbed and (init := method(c, "__init__"))]
    picked = m.Call(func=m.Subscript(value=name)) | class_choice(set(), {table})
    return uses > 0 and uses == sum(len(findall(init, picked)) for init in inits)


def _local_tables(module: cst.Module, plumbed: set[str]) -> dict[str, cst.Dict]:
    """`table = {key: A, ...}` of plumbed classes bound in a constructor and used there only to pick the class to
    build (`cls = table[key]`, `table[key](...)`; Inkling2-Loop's `layer_classes[(is_sliding, is_loop_layer)]`)."""
    table = m.Dict([m.AtLeastN(m.DictElement(value=m.OneOf(*map(m.Name, plumbed))), n=1)])
    bound = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name())], table)])
    found = {}
    for cls in classes(module).values():
        init = method(cls, "__init__")
        for s in init.body.body if init is not None else ():
            if not m.matches(s, bound):
                continue
            name, value = s.body[0].targets[0].target.value, s.body[0].value
            picked = m.Call(func=m.Subscript(value=m.Name(name))) | class_choice(set(), {name})
            if len(findall(init, m.Name(name))) - 1 == len(findall(init, picked)) > 0:  # but its binding
                found[name] = value
    return found


class ConstructorPlumbing(Rule):
    ID = "MG009"
    DESCRIPTION = "Constructors take (config, ..., infer_config, comm_manager, prefix) and pass them down."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        ctx = self.rewrite
        if ctx.entry_class not in classes(module):
            return module
        plumbed = plumbed_classes(module, ctx.entry_class)
        tables = {
            name: table
            for name, table in class_tables(module, plumbed - {ctx.entry_class}).items()
            if _built_from(module, name, plumbed)
        } | _local_tables(module, plumbed - {ctx.entry_class})
        for scope, node in _aliased(module, plumbed - {ctx.entry_class}, tables):
            ctx.unsupported(
                scope,
                0,
                f"`{node.value}` is built through an alias (a name, dict or conditional holding the class); the "
                f"rules pass the runtime contract to direct `{node.value}(...)` calls only",
            )
        new = module.visit(_Plumb(plumbed, {n: members(t) for n, t in tables.items()}))
        if new.deep_equals(module):
            return module
        self.add_needed_imports(
            [
                ("runtime.config", "InferenceConfig"),
                ("runtime.config.comm_manager", "CommManager"),
                ("runtime.layers.prefix", "join_prefix"),
            ]
        )
        return new
