"""A module applied through a lambda over a ModuleDict of its layers, minGPT's MLP:

    self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(...), c_proj=nn.Linear(...), act=NewGELU()))
    m = self.mlp
    self.mlpf = lambda x: m.c_proj(m.act(m.c_fc(x)))

becomes an in-file module class holding the same layers under the same names (every checkpoint weight keeps its
name), whose forward is the lambda's body; the owner builds it in the ModuleDict's place and calls it where it
called the lambda. The other rules then see an ordinary module (`skill parallelize` splits the MLP). A lambda
that reads anything but its parameters and the ModuleDict's layers, a ModuleDict built from the owner's locals,
or one the owner reads otherwise, stays."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import (
    Transformer,
    assigned_names,
    classes,
    code,
    findall,
    free_names,
    method,
    stmt,
)
from skills.migrator.rule import Rule
from skills.migrator.rules.module_dict_model import HELD_DICT, module_dict_items

ALIAS = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name())], m.Attribute(m.Name("self"), m.Name()))])
LAMBDA = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Attribute(m.Name("self")))], m.Lambda())])


class _Through(Transformer):
    """`<alias>.<layer>` or `self.<dict>.<layer>` -> `self.<layer>`."""

    def __init__(self, alias: str | None, held: str):
        holder = m.Attribute(m.Name("self"), m.Name(held))
        self.holders = holder | m.Name(alias) if alias else holder

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.BaseExpression:
        return (
            updated.with_changes(value=cst.Name("self"))
            if m.matches(updated.value, self.holders)
            else updated
        )


class _Calls(Transformer):
    """`self.<fn>(...)` -> `self.<held>(...)`."""

    def __init__(self, fn: str, held: str):
        self.fn, self.held = fn, held

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if m.matches(updated.func, m.Attribute(m.Name("self"), m.Name(self.fn))):
            return updated.with_changes(func=cst.Attribute(cst.Name("self"), cst.Name(self.held)))
        return updated


def _target(line: cst.SimpleStatementLine) -> str:
    target = line.body[0].targets[0].target
    return target.attr.value if isinstance(target, cst.Attribute) else target.value


class LambdaModules(Rule):
    ID = "MG041"
    DESCRIPTION = "A lambda over a ModuleDict of layers (minGPT's MLP) becomes a module class holding them."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        local = classes(module)
        body = []
        for s in module.body:
            found = self._split(s, local) if isinstance(s, cst.ClassDef) else None
            if found is None:
                body.append(s)
                continue
            made, owner = found
            local[made.name.value] = made
            spaced = [cst.EmptyLine(indent=False)] * 2
            body += [
                made.with_changes(leading_lines=s.leading_lines),
                owner.with_changes(leading_lines=spaced),
            ]
        return module.with_changes(body=body) if len(body) != len(module.body) else module

    def _split(self, cls: cst.ClassDef, local: dict) -> tuple[cst.ClassDef, cst.ClassDef] | None:
        """(the new module class, the owner building and calling it), or None."""
        init = method(cls, "__init__")
        lines = list(init.body.body) if init is not None else []
        for held in (s for s in lines if m.matches(s, HELD_DICT)):
            aliases = [
                s for s in lines if m.matches(s, ALIAS) and s.body[0].value.attr.value == _target(held)
            ]
            for fn in (s for s in lines if m.matches(s, LAMBDA)):
                if (found := self._made(cls, init, held, aliases[:1], fn, local)) is not None:
                    return found
        return None

    def _made(
        self,
        cls: cst.ClassDef,
        init: cst.FunctionDef,
        held_line: cst.SimpleStatementLine,
        alias_lines: list[cst.SimpleStatementLine],
        fn_line: cst.SimpleStatementLine,
        local: dict,
    ) -> tuple[cst.ClassDef, cst.ClassDef] | None:
        held, fn, lam = _target(held_line), _target(fn_line), fn_line.body[0].value
        items = module_dict_items(held_line.body[0].value)
        alias = _target(alias_lines[0]) if alias_lines else None
        plain = not lam.params.kwonly_params and not isinstance(
            lam.params.star_arg, cst.Param | cst.ParamStar
        )
        if items is None or not plain or lam.params.star_kwarg is not None:
            return None
        params = [p.name.value for p in lam.params.params]
        through = lam.body.visit(_Through(alias, held))
        uses = {a.attr.value for a in findall(through, m.Attribute(m.Name("self")))}
        if free_names(through) - {*params, "self"} or not uses <= {k for k, _ in items}:
            return None
        rest = [s for s in init.body.body if s is not held_line and s is not fn_line and s not in alias_lines]
        others = cst.Module([*rest, *(s for s in cls.body.body if s is not init)])
        needs = set().union(*(free_names(v) for _, v in items))
        if (
            (alias is not None and alias in free_names(others))
            or findall(others, m.Attribute(m.Name("self"), m.Name(held)))
            or needs & {n for s in rest for n in assigned_names(s)}
            or not findall(others, m.Call(m.Attribute(m.Name("self"), m.Name(fn))))
        ):
            return None
        passed = ", ".join(p.name.value for p in init.params.params if p.name.value in needs)
        name = f"{cls.name.value}{held.title().replace('_', '')}"
        while name in local:
            name = f"_{name}"
        layers = "".join(f"        self.{k} = {code(v)}\n" for k, v in items)
        made = cst.parse_module(
            f"class {name}(nn.Module):\n"
            f"    def __init__(self{', ' if passed else ''}{passed}):\n        super().__init__()\n{layers}\n"
            f"    def forward(self, {', '.join(params)}):\n        return {code(through)}\n"
        ).body[0]
        built = stmt(f"self.{held} = {name}({passed})\n")
        new_init = init.with_changes(
            body=init.body.with_changes(
                body=[built if s is held_line else s for s in init.body.body if s is held_line or s in rest]
            )
        )
        calls = _Calls(fn, held)
        owner = cls.with_changes(
            body=cls.body.with_changes(
                body=[new_init if s is init else s.visit(calls) for s in cls.body.body]
            )
        )
        return made, owner
