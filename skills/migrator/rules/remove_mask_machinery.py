"""HF builds 4-D attention masks (`create_causal_mask`, sliding-window variants, mask dicts); the
runtime's attention masks from ForwardMetaData instead. Statements that build masks, and everything
computed only from them, are removed; call arguments that pass them on are dropped."""

import re

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import (
    Transformer,
    assigned_names,
    findall,
    free_names,
    names_in,
    read_names,
    with_args,
)
from skills.migrator.rule import Rule

MASK_FACTORY = re.compile(r"(^|_)(create|make|prepare|preprocess)\w*mask", re.IGNORECASE)
# a model's own method that builds HF's attention masks (`self._create_attention_masks(...)`); other `*_mask`
# methods may compute model maths (Doge's `prepare_dynamic_mask` is an attention bias)
MASK_METHOD = re.compile(r"(^|_)(create|make|prepare|update)_\w*(attention|causal)_masks?$")


def _builds_mask(node: cst.CSTNode) -> bool:
    """Calls or names a mask factory (`create_causal_mask`, `mask_function = create_... if ... else ...`,
    `self._create_attention_masks(...)`)."""
    methods = (a.attr.value for a in findall(node, m.Attribute(value=m.Name("self"))))
    return any(MASK_FACTORY.search(n) for n in free_names(node)) or any(
        MASK_METHOD.search(n) for n in methods
    )


def _clean_loop_targets(stmt: cst.CSTNode, tainted: set[str]) -> set[str]:
    """Names bound by the for-loops under stmt that iterate over something else than a mask."""
    loops = [loop for loop in findall(stmt, m.For()) if not names_in(loop.iter) & tainted]
    return {n for loop in loops for n in names_in(loop.target)}


class _DropTaintedArgs(Transformer):
    def __init__(self, tainted: set[str]):
        self.tainted = tainted

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        """Keyword arguments carrying a mask are dropped; positional ones become None (positions stay)."""
        args = []
        for a in updated.args:
            if not names_in(a.value) & self.tainted or a.star:
                args.append(a)
            elif not a.keyword and self._carries_mask(a.value):
                args.append(a.with_changes(value=cst.Name("None")))
            elif not a.keyword:
                args.append(a)
        return with_args(updated, args) if args != list(updated.args) else updated

    def _carries_mask(self, value: cst.BaseExpression) -> bool:
        """A mask itself: a tainted name, or an entry of a tainted mapping (`causal_mask_mapping["full"]`)."""
        while isinstance(value, cst.Subscript):
            value = value.value
        return isinstance(value, cst.Name) and value.value in self.tainted


PASS_BODY = m.IndentedBlock([m.SimpleStatementLine([m.Pass()])])


def _emptied(stmt: cst.BaseStatement) -> bool:
    """A loop or with-block left with nothing but `pass` (its mask statements went)."""
    return isinstance(stmt, (cst.For, cst.While, cst.With)) and m.matches(stmt.body, PASS_BODY)


class _Clean(Transformer):
    """One pass over a function body: removes mask statements, records what they bound."""

    def __init__(self, tainted: set[str]):
        self.tainted = tainted

    def _is_mask(self, stmt: cst.BaseStatement) -> bool:
        """Builds a mask, uses one, or only binds mask names (compound statements count as a whole); a
        statement that also binds other names stays (`h, pos, mask = self.f(h, pos, mask)`)."""
        if _builds_mask(stmt) or read_names(stmt) & self.tainted:
            return True
        bound = assigned_names(stmt)  # only (re)initialises mask names: `causal_mask_mapping = {}`
        return bool(bound) and bound <= self.tainted

    def on_leave(self, original, updated):
        if isinstance(updated, cst.IndentedBlock):
            kept = []
            for before, s in zip(original.body, updated.body, strict=True):
                s = s.visit(_DropTaintedArgs(self.tainted))
                if self._is_mask(s) or (_emptied(s) and not _emptied(before)):
                    self.tainted |= assigned_names(s) - _clean_loop_targets(s, self.tainted)
                else:
                    kept.append(s)
            return updated.with_changes(body=kept or [cst.SimpleStatementLine([cst.Pass()])])
        return updated


class _PerFunction(Transformer):
    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        if not _builds_mask(updated.body):
            return updated
        tainted: set[str] = set()
        while True:  # fixpoint: a removal can taint names used earlier in loops
            before = len(tainted)
            cleaner = _Clean(tainted)
            updated = updated.with_changes(body=updated.body.visit(cleaner))
            tainted = cleaner.tainted
            if len(tainted) == before:
                return updated


def _bidirectional_by_config(module: cst.Module, config: object) -> bool:
    """The checkpoint's config says `is_decoder: false` to code that keys its mask on it (BERT-style models build
    a bidirectional mask then)."""
    keyed = m.Attribute(
        value=m.Name("config") | m.Attribute(attr=m.Name("config")), attr=m.Name("is_decoder")
    )
    bidirectional = any("bidirectional" in n for n in free_names(module))
    return getattr(config, "is_decoder", None) is False and bidirectional and bool(findall(module, keyed))


class RemoveMaskMachinery(Rule):
    ID = "MG003"
    DESCRIPTION = "HF's 4-D attention mask building goes; the runtime's attention masks from ForwardMetaData."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        ctx = self.rewrite
        if _bidirectional_by_config(module, ctx.checkpoint_config):
            ctx.unsupported(
                ctx.entry_class,
                0,
                "the checkpoint's config has `is_decoder: false`, so this model attends bidirectionally (a "
                "BERT-style encoder) and the runtime attends causally; set `is_decoder: true` in its config.json "
                "if it is a decoder",
            )
        module = module.visit(_PerFunction())
        defined = {id(f.name) for f in findall(module, m.FunctionDef())}
        used = {a.attr.value for a in findall(module, m.Attribute())} | {
            n.value for n in findall(module, m.Name()) if id(n) not in defined
        }
        return module.visit(_DropMaskMethods(used))


class _DropMaskMethods(Transformer):
    """Methods named as mask factories (`_create_attention_masks`) that nothing calls any more."""

    def __init__(self, used: set[str]):
        self.used = used

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        body = [
            s
            for s in updated.body.body
            if not (
                isinstance(s, cst.FunctionDef)
                and MASK_FACTORY.search(s.name.value)
                and s.name.value not in self.used
            )
        ]
        return updated.with_changes(body=updated.body.with_changes(body=body)) if body else updated
