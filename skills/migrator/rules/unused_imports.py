"""Imports nothing uses any more are removed (libcst decides by scope analysis), and with them an `if` at the top
of the file that only guarded such imports (`if is_flash_attn_available():`)."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import dotted, findall, free_names
from skills.migrator.effects import computes_only
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
    return {
        a.asname.name.value if a.asname else dotted(a.name).split(".")[0]
        for a in findall(node, m.ImportAlias())
    }


class UnusedImports(Rule):
    ID = "MG015"
    DESCRIPTION = "Imports nothing uses any more are removed (scope analysis)."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        module = module.with_changes(body=[s for s in module.body if not _guards_unused_imports(s, module)])
        for s in module.body:
            for small in s.body if isinstance(s, cst.SimpleStatementLine) else []:
                if (
                    isinstance(small, cst.ImportFrom)
                    and small.module
                    and not isinstance(small.names, cst.ImportStar)
                ):
                    mod = cst.Module([]).code_for_node(small.module)
                    if mod == "__future__":
                        continue
                    for alias in small.names:
                        self.remove_unused_import(
                            mod, dotted(alias.name), alias.asname.name.value if alias.asname else None
                        )
                elif isinstance(small, cst.Import):
                    for alias in small.names:
                        self.remove_unused_import(
                            dotted(alias.name), asname=alias.asname.name.value if alias.asname else None
                        )
        return module
