"""An in-file subclass of `nn.Linear` whose only method recomputes the linear map by hand (Falcon's `FalconLinear`:
`input @ self.weight.T`, plus `self.bias` unless it is None) is `nn.Linear`: the class goes and its constructor
calls build `nn.Linear`, so the parallel rules and the runtime's fused layers see a linear layer. The weights keep
their names and layout. A subclass that computes anything else, or has other methods or attributes, stays."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import Transformer, classes, dotted, findall, is_docstring
from skills.migrator.reachability import reachable
from skills.migrator.rule import Rule

WEIGHT, BIAS = (m.Attribute(m.Name("self"), m.Name(n)) for n in ("weight", "bias"))
TRANSPOSED = (
    m.Attribute(WEIGHT, m.Name("T"))
    | m.Call(m.Attribute(WEIGHT, m.Name("t")), [])
    | m.Call(m.Attribute(WEIGHT, m.Name("transpose")), [m.Arg(m.Integer("0")), m.Arg(m.Integer("1"))])
)

NO_BIAS = m.Comparison(BIAS, [m.ComparisonTarget(m.Is(), m.Name("None"))])


def _product(e: cst.BaseExpression, x: str) -> bool:
    return m.matches(e, m.BinaryOperation(m.Name(x), m.MatrixMultiply(), TRANSPOSED))


def _returns(s: cst.BaseStatement, value: m.BaseMatcherNode) -> bool:
    """s is `return <value>`."""
    return m.matches(s, m.SimpleStatementLine([m.Return(value)]))


def _plain_linear(forward: cst.FunctionDef) -> bool:
    """forward(self, x) computes `x @ self.weight.T`, returning it as is when `self.bias is None` and with
    `self.bias` added otherwise: directly, or through one local."""
    params = forward.params
    if (
        len(params.params) != 2
        or isinstance(params.star_arg, cst.Param)
        or params.kwonly_params
        or params.star_kwarg
    ):
        return False
    x = params.params[1].name.value
    body = [s for s in forward.body.body if not is_docstring(s)]
    product = m.Assign([m.AssignTarget(m.Name())])
    if body and m.matches(body[0], m.SimpleStatementLine([product])) and _product(body[0].body[0].value, x):
        local = m.Name(body[0].body[0].targets[0].target.value)
        body = body[1:]
    else:
        local = m.BinaryOperation(m.Name(x), m.MatrixMultiply(), TRANSPOSED)
    if len(body) != 2 or not m.matches(body[0], m.If(NO_BIAS, orelse=None)):
        return False
    branch = body[0].body.body
    with_bias = m.BinaryOperation(local, m.Add(), BIAS) | m.BinaryOperation(BIAS, m.Add(), local)
    return len(branch) == 1 and _returns(branch[0], local) and _returns(body[1], with_bias)


def _used_otherwise(module: cst.Module, entry: str) -> set[str]:
    """Names the code the entry class reaches uses other than by calling them (an `isinstance` in a weight
    initialiser of a base class it no longer derives from does not count): those classes are not only
    constructed."""
    kept = [module.body[i] for i in reachable(module, {entry})]
    calls = {id(c.func) for s in kept for c in findall(s, m.Call(m.Name()))}
    return {
        n.value
        for s in kept
        for n in findall(s, m.Name())
        if id(n) not in calls and not (isinstance(s, cst.ClassDef) and n is s.name)
    }


def _plain_linear_classes(module: cst.Module, entry: str) -> set[str]:
    """The classes to replace: those only constructed by name (not subclassed, nor tested with isinstance)."""
    found, used_otherwise = set(), _used_otherwise(module, entry)
    for name, cls in classes(module).items():
        if name in used_otherwise:
            continue
        methods = [s for s in cls.body.body if not is_docstring(s)]
        linear = [dotted(b.value) for b in cls.bases] in (["nn.Linear"], ["torch.nn.Linear"])
        only_forward = len(methods) == 1 and m.matches(methods[0], m.FunctionDef(m.Name("forward")))
        if linear and only_forward and not methods[0].decorators and _plain_linear(methods[0]):
            found.add(name)
    return found


class _Replace(Transformer):
    def __init__(self, names: set[str]):
        self.names = names

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if m.matches(updated.func, m.Name()) and updated.func.value in self.names:
            return updated.with_changes(func=cst.parse_expression("nn.Linear"))
        return updated


class PlainLinearSubclasses(Rule):
    ID = "MG028"
    DESCRIPTION = "An nn.Linear subclass that only recomputes the linear map by hand is nn.Linear."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        names = _plain_linear_classes(module, self.rewrite.entry_class)
        if not names:
            return module
        body = [s for s in module.body if not (isinstance(s, cst.ClassDef) and s.name.value in names)]
        return module.with_changes(body=body).visit(_Replace(names))
