"""Run the rewrite rules over a vendored HF source file."""

from collections.abc import Collection, Sequence

import libcst as cst
from libcst.codemod import CodemodContext
from libcst.metadata import MetadataWrapper, PositionProvider

from runtime.errors import UserError
from skills.migrator.context import RewriteContext
from skills.migrator.cst_utils import code
from skills.migrator.rule import Rule
from skills.migrator.rules import CONFIGURATION_RULES, MODELING_RULES


def _scope_lines(module: cst.Module) -> dict[str, int]:
    """Class / function name -> the line it is defined on (the first definition of a name)."""
    positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    lines: dict[str, int] = {}
    for node, position in positions.items():
        if isinstance(node, (cst.ClassDef, cst.FunctionDef)):
            lines.setdefault(node.name.value, position.start.line)
    return lines


def _code(module: cst.Module) -> str:
    """module.code (but for a trailing newline, which no rule changes) from its statements' code: a statement no
    rule touched keeps its code from before, where module.code would generate the whole file again."""
    return "".join(map(code, (*module.header, *module.body, *module.footer)))


def check_rule_ids(disabled: Collection[str], known: Sequence[type[Rule]]) -> None:
    unknown = sorted(set(disabled) - {rule.ID for rule in known})
    if unknown:
        raise UserError(
            f"--disable {', '.join(unknown)}: no such rule; the rules are "
            f"{', '.join(rule.ID for rule in known)} (see --list-rules)."
        )


def rewrite(
    source: str,
    ctx: RewriteContext,
    rules: Sequence[type[Rule]] = MODELING_RULES,
    disabled: Collection[str] = (),
) -> str:
    """Each rule not disabled, in order; ctx.applied names those that changed something."""
    module = cst.parse_module(source)
    ctx.scope_lines = _scope_lines(module)
    before = _code(module)
    for rule in rules:
        if rule.ID in disabled:
            continue
        ctx.rule = rule.ID
        module = rule(CodemodContext(filename=ctx.filename), ctx).transform_module(module)
        if (after := _code(module)) != before:
            ctx.applied.append(rule.ID)
            before = after
    ctx.rule = ""
    try:
        compile(module.code, ctx.filename, "exec")
    except SyntaxError as e:
        ctx.unsupported(
            "<module>",
            e.lineno or 0,
            f"the rewrite produced invalid code ({e.msg}); a construct in this "
            "file is not understood by the rules",
        )
    return module.code


def rewrite_configuration(source: str, ctx: RewriteContext, disabled: Collection[str] = ()) -> str:
    return rewrite(source, ctx, CONFIGURATION_RULES, disabled)
