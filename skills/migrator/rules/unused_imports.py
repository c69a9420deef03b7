"""Imports nothing uses any more are removed (libcst decides by scope analysis)."""

import libcst as cst

from skills.migrator.cst_utils import dotted
from skills.migrator.rule import Rule


class UnusedImports(Rule):
    ID = "MG015"
    DESCRIPTION = "Imports nothing uses any more are removed (scope analysis)."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
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
