"""A causal LM written flat, nanoGPT's and minGPT's way: the entry class keeps its trunk in one
`self.transformer = nn.ModuleDict(dict(wte=..., h=..., ln_f=...))`, or as attributes of its own (`self.wte`,
`self.h`, `self.ln_f`), and its forward runs it before applying the output layer. The trunk becomes an in-file
model class holding the same modules under the same names, and the statements of forward before the output
layer become that class's forward, returning what the output layer is applied to. The entry then has the inner
model the other rules expect. A ModuleDict's checkpoint names stay as they were; attributes of the entry move
under the inner model's attribute, which the entry names as its `base_model_prefix`, as transformers names the
attribute a checkpoint without it loads into (the runtime's loader reads it the same way), and the entry's other
references to them follow. A forward that reads other entry attributes there, or reads its trunk's locals after,
stays."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import (
    Transformer,
    assigned_names,
    classes,
    code,
    findall,
    free_names,
    is_docstring,
    method,
    param_names,
    stmt,
)
from skills.migrator.rule import Rule
from skills.migrator.rules.causal_lm_entry import _inner_model_attr, _vocab_linears

DICT_CALL = m.Call(m.Name("dict"), [m.AtLeastN(m.Arg(keyword=m.Name()), n=1)])
LITERAL = m.Dict([m.AtLeastN(m.DictElement(m.SimpleString()), n=1)])
_PREFIX = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name("base_model_prefix"))])])
_TIES = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name("_tied_weights_keys"))])])
MODULE_DICT = m.Call(
    m.Attribute(attr=m.Name("ModuleDict")) | m.Name("ModuleDict"), [m.Arg(DICT_CALL | LITERAL)]
)


# `self.<attr> = nn.ModuleDict(...)`
HELD_DICT = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Attribute(m.Name("self")))], MODULE_DICT)])


def module_dict_items(call: cst.Call) -> list[tuple[str, cst.BaseExpression]] | None:
    """The ModuleDict's (name, module) pairs, None when a name is not an identifier."""
    arg = call.args[0].value
    if isinstance(arg, cst.Call):
        return [(a.keyword.value, a.value) for a in arg.args]
    pairs = [(e.key.evaluated_value, e.value) for e in arg.elements]
    return pairs if all(isinstance(k, str) and k.isidentifier() for k, _ in pairs) else None


class _Held(Transformer):
    """`self.<attr>.<item>` -> `self.<item>`."""

    def __init__(self, attr: str):
        self.attr = attr

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.BaseExpression:
        if m.matches(updated.value, m.Attribute(m.Name("self"), m.Name(self.attr))):
            return updated.with_changes(value=cst.Name("self"))
        return updated


def _model_class(name: str, params: list[str], items, stored: bool, body, returned) -> cst.ClassDef:
    init = "".join(f"        self.{k} = {code(v)}\n" for k, v in items)
    keep = "        self.config = config\n" if stored else ""
    args = ", ".join(["self", *params])
    source = (
        f"class {name}(nn.Module):\n    def __init__(self, config):\n        super().__init__()\n{keep}{init}"
    )
    cls = cst.parse_module(source).body[0]
    fwd = cst.parse_module(f"def forward({args}):\n    return {code(returned)}\n").body[0]
    fwd = fwd.with_changes(body=fwd.body.with_changes(body=[*body, *fwd.body.body]))
    return cls.with_changes(
        body=cls.body.with_changes(
            body=[*cls.body.body, fwd.with_changes(leading_lines=[cst.EmptyLine(indent=False)])]
        )
    )


def _held_dict(init: cst.FunctionDef) -> cst.SimpleStatementLine | None:
    """init's one `self.<attr> = nn.ModuleDict(...)` line, where the modules are built from the config alone."""
    held = [s for s in init.body.body if m.matches(s, HELD_DICT)]
    if (
        len(held) != 1
        or "config" not in param_names(init)
        or module_dict_items(held[0].body[0].value) is None
    ):
        return None
    init_locals = {n for s in init.body.body for n in assigned_names(s)} | set(param_names(init))
    return None if free_names(held[0].body[0].value) & init_locals - {"config"} else held[0]


def _trunk(fwd: cst.FunctionDef, attr: str, head: str) -> tuple[int, cst.Call] | None:
    """(index of forward's statement applying the output layer, that call), where the statements before it read
    of the entry only the ModuleDict's modules (`self.<attr>.<name>`) and its config, and those after it none of
    their locals."""
    body = list(fwd.body.body)
    at = next((i for i, s in enumerate(body) if _applies(s, head)), None)
    if at is None:
        return None
    call = _applies(body[at], head)
    if len(call.args) != 1 or call.args[0].keyword is not None:
        return None
    trunk = cst.Module(body[:at])
    held = m.Attribute(m.Name("self"), m.Name(attr))
    reads = {code(a) for a in findall(trunk, m.Attribute(m.Name("self")))}
    whole = len(findall(trunk, held)) != len(findall(trunk, m.Attribute(held)))  # the dict itself used
    bound = {n for s in body[:at] for n in assigned_names(s)}
    if whole or reads - {f"self.{attr}", "self.config"} or free_names(cst.Module(body[at + 1 :])) & bound:
        return None
    return None if free_names(call.args[0].value) - bound - set(param_names(fwd)) else (at, call)


def _own_trunk(
    init: cst.FunctionDef, fwd: cst.FunctionDef, head: str
) -> list[cst.SimpleStatementLine] | None:
    """init's `self.<name> = <module>(...)` lines of the entry's own attributes forward reads before the output
    layer, each built from the config alone; None unless every such read is one of them."""
    body = list(fwd.body.body)
    at = next((i for i, s in enumerate(body) if _applies(s, head)), None)
    if at is None or "config" not in param_names(init):
        return None
    reads = {a.attr.value for a in findall(cst.Module(body[:at]), m.Attribute(m.Name("self")))} - {"config"}
    line = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Attribute(m.Name("self")))], m.Call())])
    built = {s.body[0].targets[0].target.attr.value: s for s in init.body.body if m.matches(s, line)}
    init_locals = {n for s in init.body.body for n in assigned_names(s)} | set(param_names(init))
    if not reads or head in reads or reads - built.keys():
        return None
    lines = [s for name, s in built.items() if name in reads]
    return None if any(free_names(s.body[0].value) & init_locals - {"config"} for s in lines) else lines


class _UnderModel(Transformer):
    """`self.<moved>` -> `self.<attr>.<moved>`."""

    def __init__(self, moved: set[str], attr: str):
        self.moved, self.attr = moved, attr

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.BaseExpression:
        if m.matches(updated, m.Attribute(m.Name("self"), m.OneOf(*map(m.Name, self.moved)))):
            return updated.with_changes(value=cst.Attribute(cst.Name("self"), cst.Name(self.attr)))
        return updated


class _TiesUnderModel(Transformer):
    """`"<moved>.<rest>"` -> `"<attr>.<moved>.<rest>"` (the names of `_tied_weights_keys`)."""

    def __init__(self, moved: set[str], attr: str):
        self.moved, self.attr = moved, attr

    def leave_SimpleString(self, original: cst.SimpleString, updated: cst.SimpleString) -> cst.SimpleString:
        value = updated.evaluated_value
        if isinstance(value, str) and "." in value and value.split(".")[0] in self.moved:
            return updated.with_changes(value=f'"{self.attr}.{value}"')
        return updated


class ModuleDictModel(Rule):
    ID = "MG037"
    DESCRIPTION = (
        "A flat entry's trunk (an nn.ModuleDict, or its own attributes) becomes an inner model class."
    )

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        local = classes(module)
        entry = local.get(self.rewrite.entry_class)
        init = method(entry, "__init__") if entry is not None else None
        fwd = method(entry, "forward") if entry is not None else None
        if init is None or fwd is None or _inner_model_attr(entry, module) is not None:
            return module
        held, heads = _held_dict(init), _vocab_linears(init)
        if len(heads) != 1:
            return module
        if held is None:
            return self._own_attributes(module, entry, init, fwd, heads[0])
        attr = held.body[0].targets[0].target.attr.value
        if (split := _trunk(fwd, attr, heads[0])) is None:
            return module
        at, call = split
        body = list(fwd.body.body)
        docs, trunk = [s for s in body[:at] if is_docstring(s)], [s for s in body[:at] if not is_docstring(s)]
        returned = call.args[0].value
        reads = free_names(cst.Module(trunk)) | free_names(returned)
        params = [p for p in param_names(fwd) if p != "self" and p in reads]
        name = self._model_name(local)
        stored = bool(findall(cst.Module(trunk), m.Attribute(m.Name("self"), m.Name("config"))))
        unheld = _Held(attr)
        model = _model_class(
            name,
            params,
            module_dict_items(held.body[0].value),
            stored,
            [s.visit(unheld) for s in trunk],
            returned.visit(unheld),
        )
        bound = {n for s in trunk for n in assigned_names(s)} | set(param_names(fwd))
        hidden = "hidden_states" if "hidden_states" not in bound else f"{attr}_out"
        passed = ", ".join(f"{p}={p}" for p in params)
        head_line = body[at].deep_replace(call, call.with_changes(args=[cst.Arg(cst.Name(hidden))]))
        new_fwd = fwd.with_changes(
            body=fwd.body.with_changes(
                body=[*docs, stmt(f"{hidden} = self.{attr}({passed})\n"), head_line, *body[at + 1 :]]
            )
        )
        new_init = init.deep_replace(held, stmt(f"self.{attr} = {name}(config)\n"))
        new_entry = entry.with_changes(
            body=entry.body.with_changes(
                body=[new_fwd if s is fwd else new_init if s is init else s for s in entry.body.body]
            ),
            leading_lines=[cst.EmptyLine(indent=False)] * 2,
        )
        at_entry = module.body.index(entry)
        model = model.with_changes(leading_lines=entry.leading_lines)
        return module.with_changes(
            body=[*module.body[:at_entry], model, new_entry, *module.body[at_entry + 1 :]]
        )

    def _own_attributes(
        self, module: cst.Module, entry: cst.ClassDef, init: cst.FunctionDef, fwd: cst.FunctionDef, head: str
    ) -> cst.Module:
        """The trunk as the entry's own attributes: gathered in a ModuleDict under a free attribute (`model`),
        which then becomes the inner model as any ModuleDict trunk does, and the entry's other references follow."""
        lines = _own_trunk(init, fwd, head)
        attr = next((a for a in ("model", "trunk") if f"self.{a}" not in code(entry)), None)
        if lines is None or attr is None:
            return module
        items = [(s.body[0].targets[0].target.attr.value, s.body[0].value) for s in lines]
        moved = {name for name, _ in items}
        gathered = stmt(
            f"self.{attr} = nn.ModuleDict(dict({', '.join(f'{k}={code(v)}' for k, v in items)}))\n"
        )
        first, taken = id(lines[0]), {id(s) for s in lines}
        kept = [
            gathered if id(s) == first else s for s in init.body.body if id(s) == first or id(s) not in taken
        ]
        under, ties = _UnderModel(moved, attr), _TiesUnderModel(moved, attr)
        new_init = init.with_changes(body=init.body.with_changes(body=kept))

        def followed(s: cst.CSTNode) -> cst.CSTNode:
            if isinstance(s, cst.FunctionDef):
                return (new_init if s is init else s).visit(under)
            return s.visit(ties) if m.matches(s, _TIES) else s

        body = [followed(s) for s in entry.body.body if not m.matches(s, _PREFIX)]
        note = "# the checkpoint names the trunk's weights as this class held them (`wte.weight`)"
        prefix = stmt(f'base_model_prefix = "{attr}"\n').with_changes(
            leading_lines=[cst.EmptyLine(comment=cst.Comment(note))]
        )
        at = 1 if body and is_docstring(body[0]) else 0
        gathered_entry = entry.with_changes(
            body=entry.body.with_changes(body=[*body[:at], prefix, *body[at:]])
        )
        staged = module.deep_replace(entry, gathered_entry)
        done = self.transform_module_impl(staged)
        return module if done is staged else done

    def _model_name(self, local: dict[str, cst.ClassDef]) -> str:
        stem = self.rewrite.entry_class
        for suffix in ("ForCausalLM", "LMHeadModel"):
            stem = stem.removesuffix(suffix)
        name = f"{stem}Model"
        while name in local:
            name = f"_{name}"
        return name


def _applies(s: cst.BaseStatement, head: str) -> cst.Call | None:
    calls = [c for c in findall(s, m.Call(m.Attribute(m.Name("self"), m.Name(head))))]
    return calls[0] if len(calls) == 1 else None
