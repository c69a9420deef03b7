"""An MLP found by what its forward does rather than by its layers' names (`w1` / `w2` / `c_proj`, `fc_in` /
`fc_out`): the linears applied to forward's input are its columns, the one applied to what only they produced,
through operations on each element alone (activations, products, sums, casts), its row. Splitting the columns
along their outputs then changes nothing but which rank computes which elements, and the row's partial sums add
up to the whole product."""

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import called_name, findall, param_names
from skills.parallel_impl.rules._units import Layer, is_docstring

# functions of one tensor that act on each element alone
ACTIVATIONS = frozenset(
    {
        "silu",
        "gelu",
        "relu",
        "sigmoid",
        "tanh",
        "mish",
        "softplus",
        "relu6",
        "leaky_relu",
        "elu",
        "selu",
        "celu",
    }
)

FUNCTION_ROOTS = frozenset({"torch", "F", "nn"})
CASTS = frozenset({"to", "float", "half", "bfloat16", "type_as", "contiguous"})
_ACTIVATION_TABLE = m.Subscript(m.Name("ACT2FN")) | m.Call(m.Name("get_activation"))


def _activation_attrs(init: cst.FunctionDef) -> set[str]:
    """Attributes __init__ sets to an activation: transformers' table, or one of torch's activation modules."""
    found = set()
    for a in findall(init, m.Assign([m.AssignTarget(m.Attribute(m.Name("self"), m.Name()))])):
        name = called_name(a.value).split(".")[-1].lower() if isinstance(a.value, cst.Call) else ""
        if m.matches(a.value, _ACTIVATION_TABLE) or name in ACTIVATIONS:
            found.add(a.targets[0].target.attr.value)
    return found


@dataclass(frozen=True)
class _Value:
    """What a local holds: forward's input as given, an element-wise function of the columns' outputs, or the
    row's output (`columns`: the columns it reads)."""

    kind: str  # "input" | "columns" | "row" | "constant"
    columns: frozenset[str] = frozenset()


INPUT, CONSTANT = _Value("input"), _Value("constant")


class _Forward:
    def __init__(self, linears: set[str], activations: set[str], first: str):
        self.linears, self.activations = linears, activations
        self.env = {first: INPUT}
        self.columns: list[str] = []
        self.row: str | None = None

    def value(self, e: cst.BaseExpression) -> _Value | None:
        if isinstance(e, (cst.Integer, cst.Float)):
            return CONSTANT
        if isinstance(e, cst.Name):
            return self.env.get(e.value)
        if isinstance(e, cst.BinaryOperation):
            arithmetic = (cst.Multiply, cst.Add, cst.Subtract, cst.Divide, cst.Power)
            return self._combined([e.left, e.right]) if isinstance(e.operator, arithmetic) else None
        if isinstance(e, cst.UnaryOperation) and isinstance(e.operator, cst.Minus):
            return self._combined([e.expression])
        return self._call(e) if isinstance(e, cst.Call) else None

    def _combined(self, parts: list[cst.BaseExpression]) -> _Value | None:
        values = [self.value(p) for p in parts]
        if any(v is None or v.kind not in ("columns", "constant") for v in values):
            return None
        read = frozenset().union(*(v.columns for v in values))
        return _Value("columns", read) if read else CONSTANT

    def _call(self, e: cst.Call) -> _Value | None:
        f, tensors = e.func, [a.value for a in e.args if a.keyword is None]
        own = f.attr.value if m.matches(f, m.Attribute(m.Name("self"))) else None
        if own in self.linears and len(e.args) == 1:
            given = self.value(tensors[0]) if tensors else None
            if given == INPUT and own not in self.columns:
                self.columns.append(own)
                return _Value("columns", frozenset({own}))
            if given is not None and given.kind == "columns" and self.row is None:
                self.row = own
                return _Value("row", given.columns)
            return None
        path = called_name(e).split(".")
        # a function (`silu(x)`, `F.gelu(x)`, `torch.tanh(x)`), or else a method of the tensor it is called on
        function = isinstance(f, cst.Name) or path[0] in FUNCTION_ROOTS
        if own in self.activations or (function and path[-1] in ACTIVATIONS):
            return self._combined(tensors) if len(tensors) == 1 else None
        if isinstance(f, cst.Attribute) and not function and own is None and path[-1] in CASTS | ACTIVATIONS:
            return self._combined([f.value])  # a tensor's method: `(a * b).to(x.dtype)`, `h.sigmoid()`
        return None


def flow_unit(
    init: cst.FunctionDef, fwd: cst.FunctionDef, linears: dict[str, Layer]
) -> tuple[tuple[str, ...], str] | None:
    """(column attrs, row attr) of the MLP forward computes with these linears (the class's only ones), else None.

    forward is straight-line (local assignments, then one return) and reads nothing but its first argument; each
    linear is called once, one or two columns on that argument, the row on their outputs combined element by
    element, and the row's output is what forward returns."""
    params = [p for p in param_names(fwd) if p != "self"]
    body = [s for s in fwd.body.body if not is_docstring(s)]
    if not params or not body or len(linears) not in (2, 3):
        return None
    flow = _Forward(set(linears), _activation_attrs(init), params[0])
    for s in body[:-1]:
        if not m.matches(s, m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name())])])):
            return None
        if (value := flow.value(s.body[0].value)) is None:
            return None
        flow.env[s.body[0].targets[0].target.value] = value
    if not m.matches(body[-1], m.SimpleStatementLine([m.Return()])) or body[-1].body[0].value is None:
        return None
    out = flow.value(body[-1].body[0].value)
    columns = tuple(flow.columns)
    if out is None or out.kind != "row" or out.columns != set(columns) or len(columns) + 1 != len(linears):
        return None
    return columns, flow.row
