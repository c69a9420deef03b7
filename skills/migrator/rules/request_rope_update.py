"""A rotary embedding decorated with transformers' `@dynamic_rope_update` (dynamic NTK and LongRoPE, whose
frequencies depend on the sequence length; MG018 has dropped it where the checkpoint pins another RoPE type) gets
the runtime's decorator of that name instead. transformers' reads the longest position of the forward, which in
the runtime's packed batch is the longest request's; the runtime's picks each token's frequencies from its own
request's length, read from `forward_metadata`. So calls of such a module pass it on: `forward_metadata=` from a
caller that takes it by name, the caller's `**kwargs` (added to its signature if missing) otherwise."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.call_sites import instance_attrs
from skills.migrator.cst_utils import (
    KwargsPassing,
    Transformer,
    appended,
    classes,
    dotted,
    findall,
    method,
    param_names,
    rewrite_classes,
)
from skills.migrator.imports import transformers_names
from skills.migrator.rule import Rule

NAME = "dynamic_rope_update"


class _FromRuntime(Transformer):
    """transformers' import of the decorator goes (the statement too, if it imported nothing else)."""

    def leave_ImportFrom(self, original: cst.ImportFrom, updated: cst.ImportFrom):
        if isinstance(updated.names, cst.ImportStar) or not updated.module:
            return updated
        if not (updated.relative or dotted(updated.module).split(".")[0] == "transformers"):
            return updated
        kept = [a for a in updated.names if dotted(a.name) != NAME or a.asname]
        if len(kept) == len(updated.names):
            return updated
        if not kept:
            return cst.RemoveFromParent()
        return updated.with_changes(
            names=[*kept[:-1], kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)]
        )


class _PassMetadata(KwargsPassing):
    """Calls `self.<attr>(...)` of the rotary modules in attrs pass forward_metadata on: by name where the caller
    takes it, else in its `**` parameter."""

    def __init__(self, attrs: set[str]):
        super().__init__()
        self.attrs = attrs
        self.params: list[list[str]] = []  # per enclosing function: its parameters

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        super().visit_FunctionDef(node)
        self.params.append(param_names(node))

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if not self.params or not m.matches(
            updated.func, m.Attribute(m.Name("self"), m.OneOf(*map(m.Name, self.attrs)))
        ):
            return updated
        if any(a.star == "**" or (a.keyword and a.keyword.value == "forward_metadata") for a in updated.args):
            return updated
        if "forward_metadata" in self.params[-1]:
            return appended(updated, "forward_metadata", "forward_metadata")
        return self.with_kwargs(updated)

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        self.params.pop()
        return super().leave_FunctionDef(original, updated)


def pass_metadata(cls: cst.ClassDef, callees: set[str]) -> cst.ClassDef | None:
    """cls with its calls of the modules of classes `callees` it holds passing forward_metadata on, or None when
    it holds none."""
    init = method(cls, "__init__")
    attrs = {a for a, (_, many) in (instance_attrs(init, callees) if init else {}).items() if not many}
    return cls.visit(_PassMetadata(attrs)) if attrs else None


def _decorated(cls: cst.ClassDef) -> bool:
    return any(dotted(d.decorator) == NAME for fn in findall(cls, m.FunctionDef()) for d in fn.decorators)


class RequestRopeUpdate(Rule):
    ID = "MG034"
    DESCRIPTION = (
        "transformers' @dynamic_rope_update becomes the runtime's, which picks frequencies per request."
    )

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        if NAME not in transformers_names(module):
            return module
        rotary = {name for name, cls in classes(module).items() if _decorated(cls)}
        if not rotary:
            return module

        module = rewrite_classes(module.visit(_FromRuntime()), lambda cls: pass_metadata(cls, rotary))
        self.add_needed_imports([("runtime.layers.rotary", NAME)])
        return module
