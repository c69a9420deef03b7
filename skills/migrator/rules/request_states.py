"""A layer that keeps state in its cache besides keys and values through transformers' linear-attention API
(`get_conv_state` / `update_conv_state`, `get_recurrent_state` / `update_recurrent_state`, `is_recording_past`:
LFM2's short convolution, Mamba's scan, Qwen3-Next's gated delta rule) runs one request at a time in the runtime,
with that request's states: its cache parameter becomes `states: RequestStates` and the method gets
`@per_request(states="states")`, so MG004 no longer folds it; the decorator always gives them, so tests of them
against None fold. Callers pass `forward_metadata` on (the decorator reads the step's requests from it). A method
keeping any other state in its cache stays MG004's refusal."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import Transformer, findall, param_names, rewrite_classes
from skills.migrator.rule import Rule
from skills.migrator.rules.fold_hf_only_params import CACHES, cache_state_methods, fold_given
from skills.migrator.rules.request_rope_update import pass_metadata

STATE_API = {"update_conv_state", "update_recurrent_state", "is_recording_past"}
READS = {"get_conv_state", "get_recurrent_state"}
STATES = "states"


class _Renamed(Transformer):
    """Every name `old` (the parameter, its reads) becomes `states`, annotated `RequestStates | None`."""

    def __init__(self, old: str):
        self.old = old

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.Name:
        return updated.with_changes(value=STATES) if updated.value == self.old else updated

    def leave_Param(self, original: cst.Param, updated: cst.Param) -> cst.Param:
        if original.name.value != self.old:
            return updated
        spaced = cst.AssignEqual(cst.SimpleWhitespace(" "), cst.SimpleWhitespace(" "))
        return updated.with_changes(
            annotation=cst.Annotation(cst.parse_expression("RequestStates | None")),
            equal=spaced if updated.default is not None else updated.equal,
        )


def _only_state_calls(fn: cst.FunctionDef, cache: str) -> bool:
    """Every use of `cache` in fn's body calls one of the state methods or compares it with None (no keys and
    values through `update`, no handing the cache to another module)."""
    name = m.Name(cache)
    uses = len(findall(fn.body, name))
    calls = len(findall(fn.body, m.Call(m.Attribute(name, m.OneOf(*map(m.Name, STATE_API | READS))))))
    none_tests = len(findall(fn.body, m.Comparison(name, [m.ComparisonTarget(comparator=m.Name("None"))])))
    return uses == calls + none_tests


def _stateful(fn: cst.FunctionDef) -> str | None:
    """The cache parameter through which fn, a module's forward, keeps linear-attention state and nothing else, or
    None. A helper method doing so (Qwen4-Exp's `self._short_conv(x, cache)`) is called without the step's
    metadata the decorator reads: MG004 refuses it."""
    caches = [p for p in param_names(fn) if p in CACHES]
    if (
        fn.name.value != "forward"
        or len(caches) != 1
        or STATES in param_names(fn)
        or not cache_state_methods(fn)
    ):
        return None
    return caches[0] if _only_state_calls(fn, caches[0]) else None


class _PerRequest(Transformer):
    def __init__(self) -> None:
        self.changed = False

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        cache = _stateful(original)
        if cache is None:
            return updated
        self.changed = True
        decorator = cst.Decorator(cst.parse_expression(f'per_request({STATES}="{STATES}")'))
        renamed = updated.visit(_Renamed(cache))
        body = fold_given(renamed.body.body, {STATES})  # the decorator always gives them
        return renamed.with_changes(
            body=renamed.body.with_changes(body=body), decorators=[*updated.decorators, decorator]
        )


class PerRequestStates(Rule):
    ID = "MG035"
    DESCRIPTION = (
        "Layers keeping conv / recurrent state in the cache run per request with the runtime's states."
    )

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        stateful: set[str] = set()

        def per_request(cls: cst.ClassDef) -> cst.ClassDef | None:
            rewriter = _PerRequest()
            out = cls.visit(rewriter)
            if rewriter.changed:
                stateful.add(cls.name.value)
                return out
            return None

        module = rewrite_classes(module, per_request)
        if not stateful:
            return module
        module = rewrite_classes(module, lambda cls: pass_metadata(cls, stateful))
        self.add_needed_imports(
            [("runtime.layers.request_states", n) for n in ("RequestStates", "per_request")]
        )
        return module
