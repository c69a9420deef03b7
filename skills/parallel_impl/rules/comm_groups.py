"""The entry class registers the process groups its parallel layers use, before building them:
`init_parallel_comm_group` (sizes read from infer_config.parallel_config at run time), called right after
`super().__init__()`."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import classes, findall, method, param_names, stmt
from skills.migrator.rule import Rule
from skills.parallel_impl.rules._units import edit_body, replace_classes

METHOD = "init_parallel_comm_group"
ORDER = (
    "attn_tp_group",
    "dense_tp_group",
    "embed_tp_group",
    "lmhead_tp_group",
    "moe_tp_group",
    "moe_ep_group",
)
SUPER_INIT = m.SimpleStatementLine(
    [m.Expr(m.Call(func=m.Attribute(m.Call(func=m.Name("super")), m.Name("__init__"))))]
)


def used_groups(module: cst.Module) -> list[str]:
    """The `tp_group="..."` / `ep_group="..."` names of the module's parallel layers, in ORDER, others after."""
    found = {
        a.value.evaluated_value
        for a in findall(module, m.Arg(m.SimpleString(), keyword=m.Name("tp_group") | m.Name("ep_group")))
    }
    return [g for g in ORDER if g in found] + sorted(found - set(ORDER))


def _method(groups: list[str]) -> cst.FunctionDef:
    names = ", ".join(f'"{g}"' for g in groups) + ("," if len(groups) == 1 else "")
    (fn,) = cst.parse_module(
        f"def {METHOD}(self, infer_config: InferenceConfig, comm_manager: CommManager | None) -> None:\n"
        '    """Registers the process groups of this model\'s parallel layers (sizes from parallel_config)."""\n'
        f"    register_tp_groups(comm_manager, infer_config.parallel_config, ({names}))\n"
    ).body
    return fn.with_changes(leading_lines=[cst.EmptyLine(indent=False)])


class RegisterCommGroups(Rule):
    ID = "PR005"
    DESCRIPTION = "The entry class registers the process groups its parallel layers use."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        ctx = self.rewrite
        cls = classes(module).get(ctx.entry_class)
        groups = used_groups(module)
        if cls is None or not groups or method(cls, METHOD) is not None:
            return module
        init = method(cls, "__init__")
        name = cls.name.value
        supers = [s for s in init.body.body if m.matches(s, SUPER_INIT)] if init is not None else []
        if not supers or not {"infer_config", "comm_manager"} <= set(param_names(init)):
            ctx.unsupported(
                name,
                0,
                "the entry class's __init__ lacks `super().__init__()` or the `infer_config` / "
                "`comm_manager` parameters: cannot register the parallel groups",
            )
            return module
        call = stmt(f"self.{METHOD}(infer_config, comm_manager)\n")
        init = edit_body(init, {id(supers[0]): [supers[0], call]})
        old_init = method(cls, "__init__")
        body = [new for s in cls.body.body for new in ([init, _method(groups)] if s is old_init else [s])]
        ctx.rewrites.append(f"{name}: {METHOD} registers {', '.join(groups)}")
        module = replace_classes(module, {name: cls.with_changes(body=cls.body.with_changes(body=body))})
        self.add_needed_imports(
            [
                ("runtime.config.comm_manager", "register_tp_groups"),
                ("runtime.config", "InferenceConfig"),
                ("runtime.config.comm_manager", "CommManager"),
            ]
        )
        return module
