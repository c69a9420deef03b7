"""What the file's names refer to, read from its import statements: `nn.Dropout` is torch.nn.Dropout after
`from torch import nn`, and a relative import keeps its dots (`.modeling_utils.PreTrainedModel`), as LibCST's
QualifiedNameProvider spells them. That provider needs a copy of the module and a scope analysis of it, which
cost a third of a rule's time; what it adds, a local variable shadowing an imported name, does not occur in
modeling code."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import dotted, findall


def import_bindings(module: cst.Module) -> dict[str, set[str]]:
    """Each name an import statement anywhere in module binds -> what it names (several under `try` / `if`)."""
    bindings: dict[str, set[str]] = {}
    for statement in findall(module, m.Import() | m.ImportFrom()):
        if isinstance(statement, cst.Import):
            for alias in statement.names:
                full = dotted(alias.name)
                local = alias.asname.name.value if alias.asname else full.split(".")[0]
                bindings.setdefault(local, set()).add(full if alias.asname else local)
        elif not isinstance(statement.names, cst.ImportStar):
            package = dotted(statement.module) if statement.module else ""
            prefix = "." * len(statement.relative) + (f"{package}." if package else "")
            for alias in statement.names:
                local = alias.asname.name.value if alias.asname else dotted(alias.name)
                bindings.setdefault(local, set()).add(prefix + dotted(alias.name))
    return bindings


def qualified_names(expr: cst.BaseExpression, bindings: dict[str, set[str]]) -> set[str]:
    """What a name or attribute chain whose head was imported names: {"torch.nn.functional.dropout"} for
    `F.dropout` after `import torch.nn.functional as F`; empty for anything else."""
    head, _, rest = dotted(expr).partition(".")
    return {f"{q}.{rest}" if rest else q for q in bindings.get(head, ())}


def transformers_names(module: cst.Module) -> set[str]:
    """Names the module's top-level statements import from transformers (absolute or relative)."""
    names: set[str] = set()
    for s in module.body:
        for small in getattr(s, "body", []) if isinstance(s, cst.SimpleStatementLine) else []:
            imported = isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar)
            if imported and (small.relative or dotted(small.module).split(".")[0] == "transformers"):
                names.update((a.asname.name.value if a.asname else dotted(a.name)) for a in small.names)
    return names
