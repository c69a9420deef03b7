"""Checkpoints keep q_proj/k_proj/v_proj and gate_proj/up_proj apart: the entry class gets a
`stacked_params_mapping` of the fusions made, which its `load_weights` passes to `load_named_weights`."""

from __future__ import annotations

import json

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import Transformer, appended, classes, findall, kwarg, method, stmt
from skills.migrator.rule import Rule
from skills.parallel_impl.rules._units import is_docstring, replace_classes, replace_methods

ATTR = "stacked_params_mapping"


class _PassMapping(Transformer):
    def __init__(self):
        self.done = False

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if not m.matches(updated.func, m.Name("load_named_weights")) or kwarg(updated, ATTR) is not None:
            return updated
        self.done = True
        return appended(updated, ATTR, f"self.{ATTR}")


class StackedParams(Rule):
    ID = "PR006"
    DESCRIPTION = (
        "The entry class maps the checkpoint's separate q/k/v, gate/up tensors onto the fused layers."
    )

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        ctx = self.rewrite
        cls = classes(module).get(ctx.entry_class)
        entries = list(dict.fromkeys(ctx.fused))
        if cls is None or not entries:
            return module
        load = method(cls, "load_weights")
        passing = _PassMapping()
        new_load = load.visit(passing) if load is not None else None
        if not passing.done:
            if not findall(cls, m.Arg(keyword=m.Name(ATTR))):
                ctx.unsupported(
                    cls.name.value,
                    0,
                    "load_weights does not call `load_named_weights(self, weights)`: the "
                    "fused qkv_proj / gate_up_proj weights could not be loaded from the checkpoint",
                )
            return module
        mapping = ", ".join(f"({', '.join(json.dumps(x) for x in e)})" for e in entries)
        attr = stmt(f"{ATTR} = ({mapping}{',' if len(entries) == 1 else ''})\n")
        cls = replace_methods(cls, {"load_weights": new_load})
        body = list(cls.body.body)
        at = 1 if is_docstring(body[0]) else 0
        if at < len(body) and not body[at].leading_lines:
            body[at] = body[at].with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        body.insert(at, attr)
        ctx.rewrites.append(
            f"{cls.name.value}: load_weights loads {', '.join(sorted({e[0][1:] for e in entries}))} "
            f"from their checkpoint parts"
        )
        return replace_classes(
            module, {cls.name.value: cls.with_changes(body=cls.body.with_changes(body=body))}
        )
