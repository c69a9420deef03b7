"""Docstrings stop describing what the migrated file no longer has: a `>>>` usage example that imports or
builds names this file does not define (`LlamaModel(configuration)` from transformers) is removed, so is an entry of
a function's `Args:` section naming a parameter it no longer takes (`attention_mask`, `cache` once MG004 took them),
a docstring left empty goes, and HF doc-builder cross-references (`` [`~transformers.PreTrainedConfig`] ``)
become plain code spans. Licence headers and comments are untouched."""

import ast
import builtins
import re

import libcst as cst

from skills.migrator.cst_utils import param_names
from skills.migrator.reachability import top_level_names
from skills.migrator.rule import VisitorRule

_EXAMPLE = re.compile(r"\n?[ \t]*```(?:python|py)?[ \t]*\n(?:.*?\n)*?[ \t]*```[ \t]*(?=\n|$)", re.IGNORECASE)
_XREF = re.compile(r"\[`(~?)([\w.]+)`\]")


def _example_names(block: str) -> set[str]:
    """Names a `>>>` example imports, calls or reads ('' set when it is not Python we can parse)."""
    code = "\n".join(line.strip()[4:] for line in block.splitlines() if line.strip().startswith(">>> "))
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()
    names = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    bound = {
        t.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return names | (read - bound - set(dir(builtins)))


_ARGS = re.compile(r"^([ \t]*)Args:[ \t]*$")
_ENTRY = re.compile(r"^([ \t]*)\*{0,2}(\w+)\s*(?:\(|:)")


def _without_gone_args(text: str, params: set[str]) -> str:
    """text with the entries of its `Args:` section that name no parameter of the function dropped (an entry: a
    `name (...):` or `name:` line at the section's first indentation, and the deeper or blank lines under it), and
    the header too once nothing is left under it."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        header = _ARGS.match(lines[i])
        if not header:
            out.append(lines[i])
            i += 1
            continue
        indent, section, i = len(header.group(1)), [], i + 1
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
            section.append(lines[i])
            i += 1
        first = next((line for line in section if line.strip()), "")
        depth = len(first) - len(first.lstrip())
        kept, keep = [], True
        for line in section:
            entry = _ENTRY.match(line)
            if entry and len(entry.group(1)) == depth:
                keep = entry.group(2) in params
            if keep:
                kept.append(line)
        tail = []  # the blank lines that end the section (the closing quotes' indentation) stay
        while section and not section[-1].strip():
            tail.insert(0, section.pop())
        while kept and not kept[-1].strip():
            kept.pop()
        if kept:
            out += [header.group(0), *kept]
        elif len(out) > 1 and not out[-1].strip():
            out.pop()  # the blank line before a section that is gone
        out += tail
    return "\n".join(out)


def _xref(match: re.Match) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class StaleDocs(VisitorRule):
    ID = "MG016"
    DESCRIPTION = (
        "Docstring examples and Args entries the file no longer has go; HF doc cross-references become code."
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.defined = {name for s in node.body for name in top_level_names(s)}
        for s in node.body:
            for small in s.body if isinstance(s, cst.SimpleStatementLine) else []:
                if isinstance(small, (cst.Import, cst.ImportFrom)) and not isinstance(
                    small.names, cst.ImportStar
                ):
                    self.defined |= {
                        (a.asname.name if a.asname else a.name).value
                        for a in small.names
                        if isinstance(a.asname.name if a.asname else a.name, cst.Name)
                    }

    def _clean(self, text: str) -> str:
        def example(match: re.Match) -> str:
            names = _example_names(match.group(0))
            return "" if names and not names <= self.defined else match.group(0)

        kept = _EXAMPLE.sub(example, text)
        if kept != text:
            kept = re.sub(r"(\n[ \t]*)+(\n[ \t]*)$", r"\2", kept)  # no blank lines left before the quotes
        return _XREF.sub(_xref, kept)

    def _body(self, updated, params: set[str] | None = None):
        body = (
            list(updated.body.body)
            if isinstance(updated, (cst.ClassDef, cst.FunctionDef))
            else list(updated.body)
        )
        first = body[0] if body else None
        if not (m_doc := self._docstring(first)):
            return updated
        prefix, quote, text = m_doc
        cleaned = self._clean(text if params is None else _without_gone_args(text, params))
        if cleaned == text:
            return updated
        if not cleaned.strip() and len(body) > 1:
            body = body[1:]
        else:
            doc = cst.SimpleString(f"{prefix}{quote}{cleaned}{quote}")
            body[0] = first.with_changes(body=[first.body[0].with_changes(value=doc)])
        if isinstance(updated, cst.Module):
            return updated.with_changes(body=body)
        return updated.with_changes(body=updated.body.with_changes(body=body))

    @staticmethod
    def _docstring(stmt) -> tuple[str, str, str] | None:
        if not (isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Expr)):
            return None
        value = stmt.body[0].value
        if not isinstance(value, cst.SimpleString):
            return None
        prefix, quote = value.prefix, value.quote
        return prefix, quote, value.value[len(prefix) + len(quote) : -len(quote)]

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        return self._body(updated)

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        p = updated.params
        star = [x.name.value for x in (p.star_arg, p.star_kwarg) if isinstance(x, cst.Param)]
        return self._body(updated, {*param_names(updated), *star})
