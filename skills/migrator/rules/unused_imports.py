"""Imports nothing uses any more are removed, and with them an `if` at the top of the file that only guarded such
imports (`if is_flash_attn_available():`). A top-level import line is kept in part or whole where the rest of
the file reads a name it binds, names it in a string annotation or exports it in `__all__`. That is what LibCST's
scope analysis counts, but for cases modeling code does not have, where this rule keeps an import LibCST's
would drop: a local of the same name, an import re-done inside a function, imports nested in a block or sharing
a line with other statements (left alone)."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import dotted, findall, free_names
from skills.migrator.effects import computes_only
from skills.migrator.imports import import_bindings, qualified_names
from skills.migrator.rule import Rule

_IMPORTS = m.SimpleStatementLine([m.AtLeastN(m.Import() | m.ImportFrom(), n=1)])


def _guards_unused_imports(s: cst.BaseStatement, module: cst.Module) -> bool:
    """s is `if <test without effects>:` (no else) around imports whose names the rest of the file never reads."""
    if not (isinstance(s, cst.If) and s.orelse is None and computes_only(s.test)):
        return False
    if not all(m.matches(x, _IMPORTS) for x in s.body.body):
        return False
    rest = cst.Module([x for x in module.body if x is not s and not m.matches(x, _IMPORTS)])
    return not _imported_names(s.body) & free_names(rest)


def _imported_names(node: cst.CSTNode) -> set[str]:
    return {_bound(a) for a in findall(node, m.ImportAlias())}


def _bound(alias: cst.ImportAlias) -> str:
    return alias.asname.name.value if alias.asname else dotted(alias.name).split(".")[0]


def _used_names(module: cst.Module) -> set[str]:
    """What the file outside its top-level import lines reads, annotates in strings or exports."""
    rest = cst.Module([s for s in module.body if not m.matches(s, _IMPORTS)])
    in_imports = {id(n) for i in findall(rest, m.Import() | m.ImportFrom()) for n in findall(i, m.Name())}
    exports = findall(rest, m.Assign(targets=[m.AssignTarget(m.Name("__all__"))]))
    exported = {s.evaluated_value for e in exports for s in findall(e.value, m.SimpleString())}
    return free_names(rest, in_imports) | _string_annotation_names(rest, import_bindings(module)) | exported


def _string_annotation_names(rest: cst.Module, bindings: dict[str, set[str]]) -> set[str]:
    """Names the string annotations (`cache: "Cache"`) and TypeVar bounds of rest read, as LibCST reads them: not
    the words of a `Literal[...]`, nor strings passed to other calls."""

    def typing(e: cst.BaseExpression, name: str) -> bool:
        return f"typing.{name}" in qualified_names(e, bindings)

    strings = m.SimpleString() | m.ConcatenatedString()
    holders = [
        *findall(rest, m.Annotation()),
        *(c for c in findall(rest, m.Call()) if typing(c.func, "TypeVar")),
    ]
    skipped = {
        id(s)
        for holder in holders
        for part in findall(holder, m.Subscript() | m.Call() | m.ConcatenatedString())
        if part is not holder
        and (
            isinstance(part, cst.ConcatenatedString)  # its parts: the whole string is read
            or (isinstance(part, cst.Subscript) and typing(part.value, "Literal"))
            or (isinstance(part, cst.Call) and not typing(part.func, "TypeVar"))
        )
        for s in findall(part, strings)
        if s is not part
    }
    names: set[str] = set()
    for holder in holders:
        for s in findall(holder, strings):
            if id(s) not in skipped and isinstance(s.evaluated_value, str):
                try:
                    names |= free_names(cst.parse_module(s.evaluated_value))
                except cst.ParserSyntaxError:
                    pass  # not every string in an annotation is code
    return names


def _merged_whitespace(
    kept: cst.BaseParenthesizableWhitespace, dropped: cst.BaseParenthesizableWhitespace
) -> cst.BaseParenthesizableWhitespace:
    """The comment lines after a dropped name's comma, moved after the comma or parenthesis before it."""
    if not isinstance(dropped, cst.ParenthesizedWhitespace):
        return kept
    if not isinstance(kept, cst.ParenthesizedWhitespace):
        return dropped
    return kept.with_changes(
        empty_lines=tuple(line for line in dropped.empty_lines if line.comment is not None)
    )


def _used_part(small: cst.BaseSmallStatement, used: set[str]) -> cst.BaseSmallStatement | None:
    """The import with its unused names dropped (their comments kept); None when none is left."""
    if isinstance(small, cst.ImportFrom) and (
        small.module is None
        or isinstance(small.names, cst.ImportStar)
        or dotted(small.module) == "__future__"
    ):
        return small
    kept: list[cst.ImportAlias] = []
    changes = {}
    for alias in small.names:
        if _bound(alias) in used:
            kept.append(alias)
        elif isinstance(small, cst.ImportFrom) and isinstance(alias.comma, cst.Comma):
            after = alias.comma.whitespace_after
            if kept and isinstance(kept[-1].comma, cst.Comma):
                comma = kept[-1].comma
                kept[-1] = kept[-1].with_changes(
                    comma=comma.with_changes(
                        whitespace_after=_merged_whitespace(comma.whitespace_after, after)
                    )
                )
            elif kept:
                kept[-1] = kept[-1].with_changes(comma=alias.comma)
            elif isinstance(small.lpar, cst.LeftParen):
                before = small.lpar.whitespace_after
                changes["lpar"] = small.lpar.with_changes(whitespace_after=_merged_whitespace(before, after))
    if not kept or len(kept) == len(small.names):
        return small if kept else None
    if kept[-1] is not small.names[-1]:  # a comma left after the new last name would dangle
        kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return small.with_changes(names=kept, **changes)


def _without_unused(s: cst.BaseStatement, used: set[str]) -> list[cst.BaseStatement]:
    if not m.matches(s, _IMPORTS):
        return [s]
    body = [part for small in s.body if (part := _used_part(small, used)) is not None]
    if not body:
        return []
    if len(body) == len(s.body) and all(a is b for a, b in zip(body, s.body, strict=True)):
        return [s]
    return [s.with_changes(body=[*body[:-1], body[-1].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)])]


class UnusedImports(Rule):
    ID = "MG015"
    DESCRIPTION = "Imports nothing uses any more are removed (the file's reads, string annotations, __all__)."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        module = module.with_changes(body=[s for s in module.body if not _guards_unused_imports(s, module)])
        used = _used_names(module)
        return module.with_changes(body=[kept for s in module.body for kept in _without_unused(s, used)])
