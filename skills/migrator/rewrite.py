"""Run the rewrite rules over a vendored HF source file."""
import ast

import libcst as cst

from skills.migrator.context import RewriteContext
from skills.migrator.rules import CONFIGURATION_RULES, MODELING_RULES


def rewrite(source: str, ctx: RewriteContext, rules=MODELING_RULES) -> str:
    module = cst.parse_module(source)
    ctx.scope_lines = {n.name: n.lineno for n in ast.walk(ast.parse(source))
                       if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    for rule in rules:
        module = rule.apply(module, ctx)
    try:
        compile(module.code, ctx.filename, "exec")
    except SyntaxError as e:
        ctx.unsupported("<module>", e.lineno or 0, f"the rewrite produced invalid code ({e.msg}); a construct in this "
                        "file is not understood by the rules")
    return module.code


def rewrite_configuration(source: str, ctx: RewriteContext) -> str:
    return rewrite(source, ctx, CONFIGURATION_RULES)
