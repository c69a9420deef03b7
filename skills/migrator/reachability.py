"""Which top-level definitions the entry class needs."""

import libcst as cst

from skills.migrator.cst_utils import assigned_names, names_in


def top_level_names(s: cst.BaseStatement) -> set[str]:
    if isinstance(s, (cst.ClassDef, cst.FunctionDef)):
        return {s.name.value}
    if isinstance(s, cst.SimpleStatementLine) and isinstance(s.body[0], (cst.Assign, cst.AnnAssign)):
        return assigned_names(s)
    return set()


def _uses(s: cst.BaseStatement) -> frozenset[str] | set[str]:
    """Names a definition needs at run time: HF-only class attributes (`_can_record_outputs = {...}`) and
    the PreTrainedModel subclass (weight init, output capture) do not count."""
    if isinstance(s, cst.ClassDef):
        bases = {n for b in s.bases for n in names_in(b.value) if not n.endswith("PreTrainedModel")}
        body = [
            x
            for x in s.body.body
            if not (
                isinstance(x, cst.SimpleStatementLine)
                and top_level_names(x)
                and all(n.startswith("_") for n in top_level_names(x))
            )
        ]
        return bases | {n for x in body for n in names_in(x)}
    return names_in(s)


def reachable(module: cst.Module, roots: set[str]) -> set[int]:
    """Indices of module.body statements reachable from the definitions named in roots."""
    defs = {i: top_level_names(s) for i, s in enumerate(module.body)}
    owner = {name: i for i, names in defs.items() for name in names}
    keep = {i for i, names in defs.items() if names & roots}
    todo = list(keep)
    while todo:
        for name in _uses(module.body[todo.pop()]):
            i = owner.get(name)
            if i is not None and i not in keep:
                keep.add(i)
                todo.append(i)
    return keep
