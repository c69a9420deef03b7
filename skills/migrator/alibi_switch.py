"""Where a model turns ALiBi on: Falcon builds its ALiBi tensor only `if self.use_alibi:` (`config.alibi`) and
its attention tests `alibi is None` per call. Once the runtime's Attention owns the bias, that test is asked
of the config, in `__init__`."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import (
    SELF_ATTR,
    assigned_names,
    classes,
    code,
    findall,
    free_names,
    method,
    pure,
)


def _config_value(cls: cst.ClassDef, attr: str) -> cst.BaseExpression | None:
    """The expression of config alone that `self.<attr>` is set to, when __init__ sets it once and nothing else
    of the class does."""
    init = method(cls, "__init__")
    sets = findall(cls, m.AssignTarget(m.Attribute(m.Name("self"), m.Name(attr))))
    if init is None or len(sets) != 1:
        return None
    line = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Attribute(m.Name("self"), m.Name(attr)))])])
    value = next((s.body[0].value for s in init.body.body if m.matches(s, line)), None)
    return value if value is not None and pure(value) and free_names(value) <= {"config"} else None


def config_switch(module: cst.Module, held: set[str]) -> str | None:
    """The condition, over `config`, under which the model computes a value held in one of the names `held`:
    the test of an `if` that assigns one, read through the `self.<attr> = config...` lines of its class."""
    found = set()
    for cls in classes(module).values():
        for branch in findall(cls, m.If()):
            if not any(assigned_names(s) & held for s in branch.body.body):
                continue
            test = branch.test
            for a in findall(test, SELF_ATTR):
                value = _config_value(cls, a.attr.value)
                if value is None:
                    break
                test = test.deep_replace(a, value)
            else:
                if pure(test) and free_names(test) <= {"config"}:
                    found.add(code(test))
    return found.pop() if len(found) == 1 else None
