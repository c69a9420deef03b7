"""Attention written out by hand, as models older than transformers' attention interface compute it (scores =
q @ kᵀ, softmax, @ v; or a direct `F.scaled_dot_product_attention` call), becomes the canonical call MG005
converts: `out = heads_first_attention(self, q, k, v, scaling=...)`, heads-first on both sides as the code
around it expects ([B, H, T, D], or [B*H, T, D] for bmm).

The scores' path is read, not guessed: scale factors (a multiplier, a divisor, baddbmm's alpha; under an `if` on
attributes __init__ sets, a conditional scale), masks (the mask argument, a lower-triangular buffer, a banded
one as a sliding window), an ALiBi bias, softmax, dtype / layout / dropout steps and shape checks are
understood; anything else done to the scores (another position bias, a scale chosen per call) is refused by
name. A helper method holding the computation (`self._attn(q, k, v, mask)`) is folded into its call site and
removed; where a forward dispatches on `config._attn_implementation`, the eager path is kept. Two computations
in the two arms of one `if` (Falcon's rotary and ALiBi paths) share one cache, and a test on the ALiBi tensor
becomes a test of the config switch the model builds it under."""

import libcst as cst
import libcst.matchers as m

from runtime.layers.weights import SKIPPED_BUFFERS
from skills.migrator.alibi_switch import config_switch
from skills.migrator.cst_utils import (
    appended,
    assigned_names,
    called_name,
    classes,
    code,
    findall,
    free_names,
    is_docstring,
    kwarg,
    method,
    param_names,
    read_names,
    stmt,
)
from skills.migrator.reachability import reachable, top_level_names
from skills.migrator.rule import Rule
from skills.migrator.rules.runtime_attention import HEAD_DIM, INTERFACE
from skills.migrator.rules.runtime_attention import HEADS_FIRST as MARKER

PRODUCTS = {"torch.matmul", "torch.bmm", "matmul", "bmm"}
SCALED_PRODUCTS = {"torch.baddbmm", "baddbmm"}
EINSUM = {"torch.einsum", "einsum"}
SDPA = {"torch.nn.functional.scaled_dot_product_attention", "nn.functional.scaled_dot_product_attention"}
SDPA |= {"F.scaled_dot_product_attention", "scaled_dot_product_attention"}
SOFTMAX = {"softmax", "torch.softmax", "nn.functional.softmax", "F.softmax", "torch.nn.functional.softmax"}
PASS_THROUGH = {
    "view",
    "reshape",
    "to",
    "float",
    "half",
    "bfloat16",
    "type",
    "type_as",
    "contiguous",
    "clone",
}
CLAMPS = {"torch.max", "torch.maximum", "torch.clamp", "torch.clamp_min"}
ZERO_FILLS = ("zeros", "zeros_like", "new_zeros", "empty", "empty_like", "new_empty")


class Refused(Exception):
    """A construct on the attention scores' path that the runtime attention cannot express."""


def _data_names(node: cst.CSTNode) -> set[str]:
    return free_names(node, data_only=True)


def _product(e: cst.BaseExpression) -> tuple[cst.BaseExpression, cst.BaseExpression] | None:
    """(a, b) of `a @ b` or `torch.matmul(a, b)` / `torch.bmm(a, b)`, or of an einsum that is one."""
    if m.matches(e, m.BinaryOperation(operator=m.MatrixMultiply())):
        return e.left, e.right
    if isinstance(e, cst.Call) and called_name(e) in PRODUCTS and len(e.args) == 2:
        return e.args[0].value, e.args[1].value
    return _einsum_product(e) if isinstance(e, cst.Call) and called_name(e) in EINSUM else None


def _einsum_product(e: cst.Call) -> tuple[cst.BaseExpression, cst.BaseExpression] | None:
    """(a, b) of `torch.einsum("...ij,...jl->...il", a, b)`, a batched `a @ b` over the same leading letters;
    `...lj` for the second operand reads it transposed (`"bhqd,bhkd->bhqk"`: q @ kᵀ)."""
    spec = e.args[0].value if e.args and not e.args[0].keyword else None
    if len(e.args) != 3 or not isinstance(spec, cst.SimpleString):
        return None
    inputs, _, out = spec.evaluated_value.replace(" ", "").partition("->")
    x, _, y = inputs.partition(",")
    if len(x) < 2 or not out:
        return None
    batch, (i, j), l = x[:-2], x[-2:], out[-1]
    letters = [*batch.replace("...", "*"), i, j, l]  # `...` stands for one run of batch dims
    if y[:-2] != batch or out[:-2] != batch or out[-2:] != i + l or len(set(letters)) != len(letters):
        return None
    a, b = e.args[1].value, e.args[2].value
    if y[-2:] == j + l:
        return a, b
    return (a, cst.parse_expression(f"{code(b)}.transpose(-1, -2)")) if y[-2:] == l + j else None


def _scaled_product(e: cst.BaseExpression) -> tuple[cst.BaseExpression, ...] | None:
    """(input, a, b) of `torch.baddbmm(input, a, b, ...)` or `input.baddbmm(a, b, ...)` (batch1= / batch2=)."""
    if not isinstance(e, cst.Call) or called_name(e).split(".")[-1] != "baddbmm":
        return None
    positional = [a.value for a in e.args if not a.keyword]
    if called_name(e) not in SCALED_PRODUCTS:  # a method: its receiver is the input
        positional.insert(0, e.func.value)
    b1, b2 = kwarg(e, "batch1"), kwarg(e, "batch2")
    operands = [*positional[:3], *(x.value for x in (b1, b2) if x is not None)]
    return tuple(operands) if len(operands) == 3 else None


def _untransposed(kt: cst.BaseExpression) -> cst.BaseExpression:
    """k of kᵀ as the scores' product reads it (`k.transpose(-1, -2)`, `k.mT`); a key kept transposed
    (GPT-1's `split_heads(k, k=True)`) is transposed back."""
    if m.matches(kt, m.Call(func=m.Attribute(attr=m.Name("transpose")))) or m.matches(
        kt, m.Attribute(attr=m.Name("mT"))
    ):
        return kt.func.value if isinstance(kt, cst.Call) else kt.value
    return cst.parse_expression(f"{code(kt)}.transpose(-1, -2)")


class _Scores:
    """The scores' path through one region of statements: which names hold scores, the scale factors met, the
    buffers read as masks."""

    def __init__(self, self_buffers: set[str], alibi: set[str]):
        self.alibi_names = alibi  # names that hold an ALiBi bias
        self.alibi: list[str] | None = None  # factors of the ALiBi bias, once one is added
        self.alibi_at = 0  # scale factors met from here on scale the bias too
        self.names: set[str] = set()
        self.masks: set[str] = set()  # names holding mask values (a buffer slice, a fill value)
        self.factors: list[str] = []
        self.buffers = self_buffers  # attributes __init__ builds as buffers
        self.read_buffers: set[str] = set()
        self.softmax = False

    def scores_in(self, e: cst.CSTNode) -> bool:
        return bool(_data_names(e) & self.names)

    def is_mask(self, e: cst.BaseExpression) -> bool:
        names = free_names(e)
        subscripted = {
            s.value.attr.value
            for s in findall(e, m.Subscript(value=m.Attribute(value=m.Name("self"))))
            if s.value.attr.value in self.buffers
        }
        self.read_buffers |= subscripted
        folded = m.matches(e, m.Name("None"))  # the mask argument, already folded away
        return bool(folded or subscripted or names & self.masks or any("mask" in n for n in names))

    def add_bias(self, bias: cst.BaseExpression, factors: list[str]) -> None:
        """An ALiBi bias joins the scores (the runtime's `Attention(alibi_slopes=...)`); another is refused."""
        if self.alibi is not None or not _data_names(bias) & self.alibi_names:
            raise Refused(f"`{code(bias)}` added to the attention scores (a position bias other than ALiBi)")
        self.alibi, self.alibi_at = factors, len(self.factors)

    def alibi_scale(self) -> str | None:
        if self.alibi is None:
            return None
        factors = self.alibi + self.factors[self.alibi_at :]
        return " * ".join(factors) if factors else "1.0"

    def value(self, e: cst.BaseExpression) -> None:
        """Walk a scores expression, recording what it does; refuse what the runtime cannot do."""
        if isinstance(e, cst.Name):
            return
        if isinstance(e, cst.Call):
            return self._call(e)
        if isinstance(e, cst.BinaryOperation):
            return self._binary(e)
        raise Refused(f"`{code(e)}` on the attention scores")

    def _call(self, e: cst.Call) -> None:
        name = called_name(e)
        if isinstance(e.func, cst.Attribute) and self.scores_in(e.func.value):
            method_name = e.func.attr.value
            if method_name == "softmax":
                self.softmax = True
            elif method_name == "masked_fill" and e.args and self.is_mask(e.args[0].value):
                pass  # a causal mask's fill
            elif method_name not in PASS_THROUGH:
                raise Refused(f"`.{method_name}(...)` on the attention scores")
            return self.value(e.func.value)
        first = e.args[0].value if e.args else None
        if first is None or not self.scores_in(first):
            if name == "torch.where" and len(e.args) == 3 and self.is_mask(e.args[0].value):
                return self.value(e.args[1].value)  # a causal mask: keep the scores where it holds
            raise Refused(f"`{code(e)}` on the attention scores")
        rest = [a.value for a in e.args[1:] if not a.keyword or a.keyword.value != "dim"]
        if any(self.scores_in(a) for a in rest):
            raise Refused(f"`{code(e)}` combines the attention scores with themselves")
        if name in SOFTMAX or name.endswith(".softmax"):
            dim = kwarg(e, "dim") or (e.args[1] if len(e.args) > 1 and not e.args[1].keyword else None)
            if dim is None or code(dim.value) != "-1":
                raise Refused(f"softmax over another dimension than the keys: `{code(e)}`")
            self.softmax = True
        elif name.endswith("masked_fill") and len(e.args) > 1 and self.is_mask(e.args[1].value):
            pass  # `torch.masked_fill(scores, causal_mask, min)`
        elif not ("dropout" in name or name in CLAMPS):
            raise Refused(f"`{name}(...)` applied to the attention scores")
        return self.value(first)

    def _binary(self, e: cst.BinaryOperation) -> None:
        left, right = self.scores_in(e.left), self.scores_in(e.right)
        if left and right:
            raise Refused(f"`{code(e)}` combines the attention scores with themselves")
        scores, other = (e.left, e.right) if left else (e.right, e.left)
        self.value(scores)  # inner first: a factor applied here scales a bias added inside
        op = type(e.operator)
        if op is cst.Add or (op is cst.Subtract and left):
            if not self.is_mask(other):
                self.add_bias(other, [] if op is cst.Add else ["-1"])
        elif op is cst.Multiply:
            if not self.is_mask(other):  # GPT-1: `w * b + -1e4 * (1 - b)` with b the causal buffer
                self.factors.append(code(_scalar(other)))
        elif op is cst.Divide and left:
            self.factors.append(f"1 / ({code(_scalar(other))})")
        else:
            raise Refused(f"`{code(e)}` on the attention scores")


# a 0-d tensor of a value (`torch.full([], v ** 0.5, dtype=w.dtype)`, GPT-2's old divisor): the value scales alike
_SCALAR_TENSOR = m.Call(
    func=m.Attribute(m.Name("torch"), m.Name("full")),
    args=[m.Arg(m.List([]), keyword=None), m.Arg(), m.ZeroOrMore()],
) | m.Call(
    func=m.Attribute(m.Name("torch"), m.Name("tensor") | m.Name("scalar_tensor")),
    args=[m.Arg(keyword=None), m.ZeroOrMore(m.Arg(keyword=m.Name()))],
)


def _scalar(e: cst.BaseExpression) -> cst.BaseExpression:
    """The value a 0-d tensor is built of, or e."""
    return e.args[1 if called_name(e) == "torch.full" else 0].value if m.matches(e, _SCALAR_TENSOR) else e


def _init_buffers(init: cst.FunctionDef | None) -> set[str]:
    """The attributes __init__ builds as buffers (`self.attr = nn.Buffer(...)`, `self.register_buffer("attr", ...)`)."""
    if init is None:
        return set()
    found = set()
    for s in findall(init, m.Assign(targets=[m.AssignTarget(m.Attribute(value=m.Name("self")))])):
        if "Buffer" in code(s.value) or "tril" in code(s.value):
            found.add(s.targets[0].target.attr.value)
    for c in findall(init, m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name("register_buffer")))):
        if c.args and isinstance(c.args[0].value, cst.SimpleString):
            found.add(c.args[0].value.evaluated_value)
    return found


def _sliding_window(init: cst.FunctionDef) -> str | None:
    """The window of a banded causal buffer: `tril(ones) xor tril(ones, -W)` keeps the last W positions; built
    under `if C:` it is `W if C else None`."""
    for branch in [init, *findall(init, m.If())]:
        for s in branch.body.body:
            if not isinstance(s, cst.SimpleStatementLine):
                continue  # a nested branch is read as its own
            for c in findall(s, m.Call()):
                if called_name(c) in {"torch.tril", "tril"} and len(c.args) == 2:
                    offset = c.args[1].value
                    if not m.matches(offset, m.UnaryOperation(operator=m.Minus())):
                        raise Refused(f"causal-mask buffer with diagonal offset `{code(offset)}`")
                    window = code(offset.expression)
                    return window if branch is init else f"{window} if {code(branch.test)} else None"
    return None


def _eager_branch(s: cst.If) -> list[cst.BaseStatement]:
    """The statements `if <..._attn_implementation == "sdpa" and ...>: ... else: ...` runs for the eager
    implementation, the reference the runtime matches."""
    test = s.test
    # `impl == "sdpa" and not output_attentions`: the comparison decides alone when false
    while m.matches(test, m.BooleanOperation(operator=m.And())) and "_attn_implementation" not in code(
        test.right
    ):
        test = test.left
    compare = m.Comparison(
        m.Attribute(attr=m.Name("_attn_implementation")),
        [m.ComparisonTarget(m.Equal() | m.NotEqual(), m.SimpleString())],
    )
    if m.matches(test, m.BooleanOperation(operator=m.And(), left=compare)):
        test = test.left
    elif not m.matches(test, compare):
        raise Refused(f"attention implementation chosen by `{code(s.test)}`")
    target = test.comparisons[0]
    eager = (target.comparator.evaluated_value == "eager") == isinstance(target.operator, cst.Equal)
    if eager and isinstance(s.test, cst.BooleanOperation):
        raise Refused(f"attention implementation chosen by `{code(s.test)}`")  # true only with the rest
    if eager:
        return list(s.body.body)
    if isinstance(s.orelse, cst.If):
        raise Refused(f"attention implementation chosen by `{code(s.test)}` ... `elif`")
    return list(s.orelse.body.body) if s.orelse else []


def _weighs_values(body: list, i: int) -> bool:
    """Whether what body[i] binds reaches, through a softmax, the left side of a later product (`p @ v`)."""
    derived, softmax = assigned_names(body[i]), False
    for s in body[i + 1 :]:
        for a in findall(s, m.Assign() | m.AugAssign() | m.Return()):
            value = a.value
            if value is None or not _data_names(value) & derived:
                continue
            calls = {called_name(c) for c in findall(value, m.Call())}
            softmax |= any(c in SOFTMAX or c.endswith("softmax") for c in calls)
            products = [p for e in findall(value, m.Call() | m.BinaryOperation()) if (p := _product(e))]
            if softmax and any(_data_names(left) & derived for left, _ in products):
                return True
            derived |= assigned_names(a)
    return False


def _is_check(s: cst.BaseStatement) -> bool:
    """`if <shape or dtype test>: raise ...`"""
    return (
        isinstance(s, cst.If)
        and s.orelse is None
        and all(m.matches(x, m.SimpleStatementLine([m.Raise()])) for x in s.body.body)
    )


class _Region:
    """One run of statements computing attention: from the scores' product to the product with v."""

    def __init__(
        self,
        buffers: set[str],
        zeros: set[str] = frozenset(),
        alibi: set[str] = frozenset(),
        settled: set[str] = frozenset(),
    ):
        self.scores = _Scores(buffers, alibi)
        self.settled = settled  # attributes __init__ sets: a branch on them is decided once, at build time
        self.zeros = zeros  # names the function binds to zero-filled tensors
        self.q = self.k = self.v = None
        self.out: cst.BaseAssignTargetExpression | None = None
        self.end_value: cst.BaseExpression | None = None  # the ending statement's value, the product inside
        self.product: cst.BaseExpression | None = None
        self.dropped: set[str] = set()  # names bound by dropped statements
        self.window: str | None = None  # the sliding window of the buffer it masked with, once converted

    def start(self, s: cst.BaseStatement) -> bool:
        """Whether s starts the computation (`scores = q @ kᵀ [* scale]`, baddbmm); records q, k."""
        if not m.matches(s, m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name())])])):
            return False
        value = s.body[0].value
        for e in [value, *findall(value, m.Call() | m.BinaryOperation())]:
            if (operands := _scaled_product(e)) is not None:
                added, q, kt = operands
                self.q, self.k = q, _untransposed(kt)
                if alpha := kwarg(e, "alpha"):
                    self.scores.factors.append(code(alpha.value))
                beta = kwarg(e, "beta")
                if not (beta and code(beta.value) in {"0", "0.0"}) and not self._zeros(added):
                    self.scores.add_bias(
                        added, [code(beta.value)] if beta and code(beta.value) != "1.0" else []
                    )
                found = e
                break
            if (pair := _product(e)) is not None:
                self.q, self.k = pair[0], _untransposed(pair[1])
                found = e
                break
        else:
            return False
        self.scores.names.add(s.body[0].targets[0].target.value)
        if found is not value:
            placeholder = cst.Name("__scores__")
            self.scores.names.add("__scores__")
            self.scores.value(value.deep_replace(found, placeholder))
        return True

    def _zeros(self, e: cst.BaseExpression) -> bool:
        if isinstance(e, cst.Call):
            return called_name(e).endswith(ZERO_FILLS)
        return isinstance(e, cst.Name) and e.value in self.zeros

    def statement(self, s: cst.BaseStatement) -> bool:
        """Take one statement after the start; True when it ends the region (the product with v)."""
        if _is_check(s):
            return False
        if isinstance(s, cst.If):
            return self._branches(s)
        if not isinstance(s, cst.SimpleStatementLine) or len(s.body) != 1:
            raise Refused(f"`{code(s).strip()}` inside the attention computation")
        small = s.body[0]
        if (
            isinstance(small, cst.AugAssign)
            and m.matches(small.target, m.Name())
            and small.target.value in self.scores.names
        ):
            op = {
                cst.AddAssign: cst.Add(),
                cst.MultiplyAssign: cst.Multiply(),
                cst.DivideAssign: cst.Divide(),
            }
            if type(small.operator) not in op:
                raise Refused(f"`{code(small)}` on the attention scores")
            self.scores.value(cst.BinaryOperation(small.target, op[type(small.operator)], small.value))
            return False
        if not isinstance(small, cst.Assign) or len(small.targets) != 1:
            raise Refused(f"`{code(s).strip()}` inside the attention computation")
        target, value = small.targets[0].target, small.value
        if not self.scores.scores_in(value):
            bound = assigned_names(small)
            self.dropped |= bound
            if self.scores.is_mask(value) or "finfo" in code(value):
                self.scores.masks |= bound
            return False
        for e in [value, *findall(value, m.Call() | m.BinaryOperation())]:
            pair = _product(e)
            if pair and self.scores.scores_in(pair[0]) and not self.scores.scores_in(pair[1]):
                self.scores.value(pair[0])
                self.v, self.out, self.end_value, self.product = pair[1], target, value, e
                return True
        if not isinstance(target, cst.Name):
            raise Refused(f"`{code(s).strip()}` inside the attention computation")
        self.scores.value(value)
        self.scores.names.add(target.value)
        return False

    def _branches(self, s: cst.If) -> bool:
        before = list(self.scores.factors)
        paths = [s.body.body, s.orelse.body.body if isinstance(s.orelse, cst.Else) else []]
        if isinstance(s.orelse, cst.If):
            raise Refused(f"`elif` inside the attention computation: `{code(s.test)}`")
        seen = []
        for body in paths:
            self.scores.factors = list(before)
            for x in body:
                if self.statement(x):
                    raise Refused("the attention output computed inside a branch")
            seen.append(self.scores.factors)
        if seen[0] == seen[1]:
            return False
        read = {a.attr.value for a in findall(s.test, m.Attribute(value=m.Name("self")))}
        if not (read and read <= self.settled):
            raise Refused(f"the attention scale chosen at run time (`if {code(s.test)}`)")
        # GPT-1's `if self.scale:`: a conditional scale, which MG005 evaluates in __init__
        extra = [" * ".join(f[len(before) :]) or "1.0" for f in seen]
        self.scores.factors = [*before, f"({extra[0]} if {code(s.test)} else {extra[1]})"]
        return False

    def scaling(self) -> str:
        return " * ".join(self.scores.factors) if self.scores.factors else "1.0"


def _head_sizes_named(scaling: str, region: _Region) -> str:
    """`math.sqrt(v.size(-1))` -> `math.sqrt(attention_head_dim)`: the last size of q, k or v (held as they are,
    heads-first) is the per-head size, which MG005 knows when it builds the Attention in __init__."""
    operands = [x.value for x in (region.q, region.k, region.v) if isinstance(x, cst.Name)]
    last = m.Call(
        func=m.Attribute(attr=m.Name("size")), args=[m.Arg(m.UnaryOperation(m.Minus(), m.Integer("1")))]
    )
    last |= m.Subscript(
        value=m.Attribute(attr=m.Name("shape")),
        slice=[m.SubscriptElement(m.Index(m.UnaryOperation(m.Minus(), m.Integer("1"))))],
    )
    expr = cst.parse_expression(scaling)
    for e in findall(expr, last):
        owner = e.func.value if isinstance(e, cst.Call) else e.value.value
        if isinstance(owner, cst.Name) and owner.value in operands:
            expr = expr.deep_replace(e, cst.Name(HEAD_DIM))
    return code(expr)


def _marker(region: _Region, q=None, k=None, v=None) -> cst.Call:
    args = [code(x) for x in (q or region.q, k or region.k, v or region.v)]
    args.append(f"scaling={_head_sizes_named(region.scaling(), region)}")
    if region.window:
        args.append(f"sliding_window={region.window}")
    if alibi := region.scores.alibi_scale():
        args.append(f"alibi={alibi}")
    return cst.parse_expression(f"{MARKER}(self, {', '.join(args)})")


def _assign(
    out, value: cst.BaseExpression, inner: cst.BaseExpression, call: cst.Call, weights: str | None
) -> list:
    """`out = call` (`out, weights = call` where the weights are returned beside it: MG005 drops them, callers
    included), then `out = <value with inner replaced by out>` where value wraps inner."""
    target = (
        cst.Tuple([cst.Element(out), cst.Element(cst.Name(weights))], lpar=[], rpar=[]) if weights else out
    )
    lines = [cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(target)], call)])]
    if value is not inner:
        rewrapped = cst.Assign([cst.AssignTarget(out)], value.deep_replace(inner, out))
        lines.append(cst.SimpleStatementLine([rewrapped]))
    return lines


class _Rewriter:
    """Finds and rewrites the attention computation of one class."""

    def __init__(self, cls: cst.ClassDef, alibi: set[str]):
        self.alibi = alibi
        self.read_buffers: set[str] = set()  # causal buffers the converted computations masked with
        self.init = method(cls, "__init__")
        self.buffers = _init_buffers(self.init)
        assigned = findall(self.init, m.AssignTarget(m.Attribute(m.Name("self")))) if self.init else []
        self.settled = {a.target.attr.value for a in assigned}
        self.zeros = {
            n
            for a in findall(cls, m.Assign(value=m.Call()))
            if called_name(a.value).endswith(ZERO_FILLS)
            for n in assigned_names(a)
        }

    def window(self, region: _Region) -> str | None:
        """The sliding window of the buffer region masked with, if any (each converted region passes here)."""
        self.read_buffers |= region.scores.read_buffers
        return _sliding_window(self.init) if region.scores.read_buffers else None

    def block(self, body: list, needed_after: set[str]) -> tuple[list, _Region | None]:
        """body with its attention computation replaced, and the region found (None: nothing here)."""
        for i, s in enumerate(body):
            if isinstance(s, cst.If) and "_attn_implementation" in code(s.test):
                return self.block([*body[:i], *_eager_branch(s), *body[i + 1 :]], needed_after)
            if (sdpa := self._sdpa(s)) is not None:
                return [*body[:i], *sdpa, *body[i + 1 :]], _Region(set())
            region = _Region(self.buffers, self.zeros, self.alibi, self.settled)
            # a router's `softmax(x @ w)` weighs no values: no attention
            if not region.start(s) or not _weighs_values(body, i):
                if isinstance(s, cst.If) and (nested := self._in_branches(s, needed_after, body[i + 1 :])):
                    return [*body[:i], nested[0], *body[i + 1 :]], nested[1]
                continue
            j = next(j for j in range(i + 1, len(body)) if region.statement(body[j]))
            later = needed_after | free_names(cst.Module(body[j + 1 :]))
            weights = (region.scores.names | region.dropped) & later  # returned beside the output, at most
            if len(weights) > 1 or weights and not _only_returned(weights, body[j + 1 :]):
                used = ", ".join(sorted(weights))
                raise Refused(f"values of the attention computation used after it: {used}")
            region.window = self.window(region)
            new = _assign(
                region.out, region.end_value, region.product, _marker(region), min(weights, default=None)
            )
            return [*body[:i], *new, *body[j + 1 :]], region
        return body, None

    def _in_branches(self, s: cst.If, needed_after: set[str], rest: list) -> tuple[cst.If, _Region] | None:
        """s with the first computation inside its body, else or elif branches replaced."""
        later = needed_after | free_names(cst.Module(rest))
        new_body, found = self.block(list(s.body.body), later)
        if found is not None:
            return s.with_changes(body=s.body.with_changes(body=new_body)), found
        if isinstance(s.orelse, cst.If):
            nested = self._in_branches(s.orelse, needed_after, rest)
            return (s.with_changes(orelse=nested[0]), nested[1]) if nested else None
        if isinstance(s.orelse, cst.Else):
            new_body, found = self.block(list(s.orelse.body.body), later)
            if found is not None:
                return s.with_changes(
                    orelse=s.orelse.with_changes(body=s.orelse.body.with_changes(body=new_body))
                ), found
        return None

    def _sdpa(self, s: cst.BaseStatement) -> list | None:
        if not m.matches(s, m.SimpleStatementLine([m.Assign([m.AssignTarget()])])):
            return None
        value = s.body[0].value
        call = next(
            (
                c
                for c in [value, *findall(value, m.Call())]
                if isinstance(c, cst.Call) and called_name(c) in SDPA
            ),
            None,
        )
        if call is None:
            return None
        q, k, v = (a.value for a in call.args[:3])
        scale = kwarg(call, "scale")
        scaling = f", scaling={code(scale.value)}" if scale else ""
        marker = cst.parse_expression(f"{MARKER}(self, {code(q)}, {code(k)}, {code(v)}{scaling})")
        return _assign(s.body[0].targets[0].target, value, call, marker, None)


def _only_returned(names: set[str], body: list) -> bool:
    """Whether names appear after the attention only as whole elements of returned tuples (`return out, w`)."""
    returns = findall(cst.Module(body), m.Return(value=m.Tuple()))
    in_returns = sum(
        1
        for r in returns
        for e in r.value.elements
        if isinstance(e.value, cst.Name) and e.value.value in names
    )
    uses = sum(1 for n in findall(cst.Module(body), m.Name()) if n.value in names)
    return uses == in_returns


def _alibi_names(module: cst.Module) -> set[str]:
    """Names holding an ALiBi bias: those naming it (`alibi`), and the keywords the file passes one by
    (MPT's `position_bias=alibi`)."""
    named = {n.value for n in findall(module, m.Name()) if "alibi" in n.value.lower()}
    passed = {
        a.keyword.value
        for a in findall(module, m.Arg(keyword=m.Name()))
        if any("alibi" in n.lower() for n in _data_names(a.value))
    }
    return named | passed


def _candidates(module: cst.Module, entry: str) -> list[str]:
    """Classes the entry reaches with a forward (or helper) computing a softmax between two products, or calling
    scaled_dot_product_attention, and no attention-interface call."""
    used = {n for i in reachable(module, {entry}) for n in top_level_names(module.body[i])}
    found = []
    for name, cls in classes(module).items():
        if name not in used or method(cls, "forward") is None:
            continue
        calls = {called_name(c) for c in findall(cls, m.Call())}
        if calls & INTERFACE:
            continue
        if calls & SDPA or (
            any(c in SOFTMAX or c.endswith(".softmax") for c in calls)
            and (
                calls & (PRODUCTS | SCALED_PRODUCTS | EINSUM)
                or findall(cls, m.BinaryOperation(operator=m.MatrixMultiply()))
            )
        ):
            found.append(name)
    return found


class HandWrittenAttention(Rule):
    ID = "MG021"
    DESCRIPTION = "Attention written out by hand (q @ kᵀ, softmax, @ v) becomes the canonical attention call."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        names = _candidates(module, self.rewrite.entry_class)
        if not names:
            return module
        self.current, self.alibi = module, _alibi_names(module)
        body = list(module.body)
        for i, s in enumerate(body):
            if isinstance(s, cst.ClassDef) and s.name.value in names:
                try:
                    body[i] = self._rewrite(s)
                except Refused as e:
                    self.rewrite.unsupported(s.name.value, 0, f"hand-written attention: {e}")
        return module.with_changes(body=body)

    def _rewrite(self, cls: cst.ClassDef) -> cst.ClassDef:
        rewriter = _Rewriter(cls, self.alibi)
        fwd = method(cls, "forward")
        body, region = rewriter.block(list(fwd.body.body), set())
        if region is None:
            return _without_unread_buffers(_fold_helper(cls, fwd, rewriter), rewriter.read_buffers)
        body, second = rewriter.block(body, set())
        if second is not None:  # Falcon: its rotary and ALiBi paths, picked per call
            if rewriter.block(body, set())[1] is not None:
                raise Refused("three attention computations in one forward")
            body = _on_one_cache(body)
        cls = _replaced(cls, fwd, fwd.with_changes(body=fwd.body.with_changes(body=body)))
        if any(r is not None and r.scores.alibi is not None for r in (region, second)):
            cls = self._alibi_by_config(cls)
        return _without_unread_buffers(cls, rewriter.read_buffers)

    def _alibi_by_config(self, cls: cst.ClassDef) -> cst.ClassDef:
        """`if alibi is None:` on the ALiBi tensor a forward is passed, which the runtime's Attention replaces,
        becomes `if not self.use_alibi:`, set in __init__ from the config switch under which the model built it."""
        fwd, init = method(cls, "forward"), method(cls, "__init__")
        held = self.alibi & set(param_names(fwd))
        none = m.Comparison(
            m.OneOf(*map(m.Name, held)), [m.ComparisonTarget(m.Is() | m.IsNot(), m.Name("None"))]
        )
        tests = findall(fwd, none) if held else []
        if not tests:
            return cls
        source = cst.parse_module(self.rewrite.source) if self.rewrite.source else self.current
        switch = config_switch(source, self.alibi)
        if switch is None or "config" not in param_names(init) or "self.use_alibi" in code(cls):
            raise Refused(
                f"ALiBi used or not per call (`{code(tests[0])}`), with no config switch found for it"
            )

        def switched(test: cst.Comparison, _) -> cst.BaseExpression:
            on = cst.parse_expression("self.use_alibi")
            return (
                cst.UnaryOperation(cst.Not(), on) if isinstance(test.comparisons[0].operator, cst.Is) else on
            )

        new_fwd = m.replace(fwd, none, switched)
        line = stmt(f"self.use_alibi = {switch}\n")
        new_init = init.with_changes(body=init.body.with_changes(body=[*init.body.body, line]))
        return _replaced(_replaced(cls, fwd, new_fwd), init, new_init)


def _on_one_cache(body: list) -> list:
    """Two computations in the two arms of one `if` (Falcon's rotary and ALiBi paths): a forward runs one of them,
    on the one cache HF updates before the branch; the later one is marked to share the earlier one's."""
    fn = cst.Module(body)
    first, second = findall(fn, m.Call(func=m.Name(MARKER)))

    def holds(arm: cst.CSTNode, call: cst.Call) -> bool:
        return any(c is call for c in findall(arm, m.Call(func=m.Name(MARKER))))

    if not any(
        branch.orelse is not None and holds(branch.body, first) and holds(branch.orelse, second)
        for branch in findall(fn, m.If())
    ):
        raise Refused(
            "two attention computations in one forward that may both run: each would need a runtime Attention "
            "and KV cache of its own"
        )
    return list(fn.deep_replace(second, appended(second, "shares_cache", "True")).body)


def _without_unread_buffers(cls: cst.ClassDef, buffers: set[str]) -> cst.ClassDef:
    """The causal buffers the runtime's masks replace go once nothing reads them, with the __init__ statements
    that only built them (GPT-Neo's `bias = torch.tril(...)`, made banded under `if attention_type == ...`)."""
    init = method(cls, "__init__")
    elsewhere = [s for s in cls.body.body if s is not init]
    read = {a.attr.value for a in findall(cst.Module(elsewhere), m.Attribute(m.Name("self")))}
    if not (gone := buffers - read):
        return cls
    body = [s for s in init.body.body if not _builds(s, gone)]
    feeders = set().union(*(read_names(s) for s in init.body.body if _builds(s, gone)))
    saved = sorted(gone & _persistent_buffers(init))
    while True:  # a statement binding only feeders nobody reads any more goes, and what fed it joins them
        unread = next(
            (
                s
                for s in body
                if _binds_locals_only(s)
                and (bound := assigned_names(s)) <= feeders
                and not bound & set().union(*(read_names(x) for x in body if x is not s))
            ),
            None,
        )
        if unread is None:
            break
        feeders |= read_names(unread)
        body = [s for s in body if s is not unread]
    cls = _replaced(cls, init, init.with_changes(body=init.body.with_changes(body=body)))
    if not saved:
        return cls
    names = ", ".join(f'"{n}"' for n in saved) + ("," if len(saved) == 1 else "")
    comment = (
        "# the checkpoint's causal-mask buffers, which the runtime's attention replaces: loading skips them"
    )
    note = cst.EmptyLine(comment=cst.Comment(comment))
    line = stmt(f"{SKIPPED_BUFFERS} = ({names})\n").with_changes(leading_lines=[note])
    at = 1 if cls.body.body and is_docstring(cls.body.body[0]) else 0
    rest = [s.with_changes(leading_lines=[cst.EmptyLine(indent=False)]) for s in cls.body.body[at : at + 1]]
    body = [*cls.body.body[:at], line, *rest, *cls.body.body[at + 1 :]]
    return cls.with_changes(body=cls.body.with_changes(body=body))


def _persistent_buffers(init: cst.FunctionDef) -> set[str]:
    """The buffers __init__ registers that state_dict keeps (no `persistent=False`), so checkpoints hold them."""
    kept = set()
    for c in findall(init, m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name("register_buffer")))):
        if c.args and isinstance(c.args[0].value, cst.SimpleString) and not _unsaved(c):
            kept.add(c.args[0].value.evaluated_value)
    buffer = m.Call(func=m.Attribute(attr=m.Name("Buffer")) | m.Name("Buffer"))
    for a in findall(init, m.Assign([m.AssignTarget(m.Attribute(m.Name("self")))], buffer)):
        if not _unsaved(a.value):
            kept.add(a.targets[0].target.attr.value)
    return kept


def _unsaved(call: cst.Call) -> bool:
    flag = kwarg(call, "persistent")
    return flag is not None and m.matches(flag.value, m.Name("False"))


def _binds_locals_only(s: cst.BaseStatement) -> bool:
    """`x = ...` lines, or an `if` (no else) of them: nothing but local names is written."""
    if isinstance(s, cst.If):
        return s.orelse is None and all(_binds_locals_only(x) for x in s.body.body)
    local = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name())])])
    return m.matches(s, local)


def _builds(s: cst.BaseStatement, attrs: set[str]) -> bool:
    """`self.<attr> = ...` or `self.register_buffer("<attr>", ...)` for one of attrs."""
    assign = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Attribute(m.Name("self"), m.Name()))])])
    if m.matches(s, assign):
        return s.body[0].targets[0].target.attr.value in attrs
    register = m.SimpleStatementLine([m.Expr(m.Call(m.Attribute(m.Name("self"), m.Name("register_buffer"))))])
    if m.matches(s, register) and s.body[0].value.args:
        name = s.body[0].value.args[0].value
        return isinstance(name, cst.SimpleString) and name.evaluated_value in attrs
    return False


def _replaced(cls: cst.ClassDef, old: cst.FunctionDef, new: cst.FunctionDef | None) -> cst.ClassDef:
    body = [new if s is old else s for s in cls.body.body if s is not old or new is not None]
    return cls.with_changes(body=cls.body.with_changes(body=body))


def _fold_helper(cls: cst.ClassDef, fwd: cst.FunctionDef, rewriter: _Rewriter) -> cst.ClassDef:
    """`a, w = self._attn(q, k, v, mask)` with the helper `_attn` holding the whole computation ->
    `a, w = heads_first_attention(self, q, k, v, ...)`, the helper removed."""
    helpers = {
        c.func.attr.value
        for c in findall(fwd, m.Call(func=m.Attribute(value=m.Name("self"))))
        if method(cls, c.func.attr.value) is not None
    }
    for name in sorted(helpers):
        helper = method(cls, name)
        calls = findall(cls, m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(name))))
        body = list(helper.body.body)
        if not body or not m.matches(body[-1], m.SimpleStatementLine([m.Return(m.DoNotCare())])):
            continue
        body = _named_return(body, helper)
        ret = body[-1]
        _, region = rewriter.block(body[:-1], free_names(ret))
        if region is None or region.out is None:  # no product ends it (a direct SDPA call): left to MG005
            continue
        if len(calls) != 1:
            raise Refused(f"attention helper `{name}` called {len(calls)} times")
        returned = ret.body[0].value
        outputs = returned.elements if isinstance(returned, cst.Tuple) else None
        first = outputs[0].value if outputs else returned
        if code(first) != code(region.out):
            raise Refused(f"attention helper `{name}` returns `{code(returned)}`")
        bound = _bind(helper, calls[0])
        q, k, v = (_resolve(e, body, bound) for e in (region.q, region.k, region.v))
        marker = _marker(region, q, k, v)
        new_fwd = fwd.deep_replace(calls[0], marker)
        if region.end_value is not region.product:  # GPT-1's `return [w @ v]`: the caller gets the list
            new_fwd = _wrapped_at_call(new_fwd, marker, region)
        return _replaced(_replaced(cls, fwd, new_fwd), helper, None)
    return cls


def _named_return(body: list, helper: cst.FunctionDef) -> list:
    """`return <expression>` as `attn_output = <expression>` then `return attn_output` (Qwen's `return
    torch.matmul(attn_weights, value)`), so that the computation ends at a name as a region does."""
    value = body[-1].body[0].value
    if m.matches(value, m.Name() | m.Tuple() | m.List()):
        return body
    name = "attn_output"
    while name in free_names(helper) | assigned_names(helper):
        name += "_"
    return [*body[:-1], stmt(f"{name} = {code(value)}\n"), stmt(f"return {name}\n")]


def _wrapped_at_call(fwd: cst.FunctionDef, marker: cst.Call, region: _Region) -> cst.FunctionDef:
    """`out = marker` -> `out = marker; out = <what the helper wrapped its product in, around out>`."""
    line = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name())], value=m.Call())])
    at = next((s for s in fwd.body.body if m.matches(s, line) and s.body[0].value is marker), None)
    if at is None or _data_names(region.end_value) - _data_names(region.product):
        raise Refused(f"the attention helper's output `{code(region.end_value)}` used inside an expression")
    out = at.body[0].targets[0].target
    lines = _assign(out, region.end_value, region.product, marker, None)
    body = [x for s in fwd.body.body for x in (lines if s is at else [s])]
    return fwd.with_changes(body=fwd.body.with_changes(body=body))


def _bind(helper: cst.FunctionDef, call: cst.Call) -> dict[str, cst.BaseExpression]:
    params = [p for p in helper.params.params if p.name.value != "self"]
    bound = {p.name.value: p.default for p in params if p.default is not None}
    positional = [a for a in call.args if not a.keyword and not a.star]
    bound.update({p.name.value: a.value for p, a in zip(params, positional)})
    bound.update({a.keyword.value: a.value for a in call.args if a.keyword})
    return bound


def _resolve(e: cst.BaseExpression, body: list, bound: dict[str, cst.BaseExpression]) -> cst.BaseExpression:
    """A helper's operand as its caller writes it: through the helper's own reshapes and casts
    (`query = query.view(...)`, `.to(torch.float32)`) back to the argument passed."""
    root = e
    while isinstance(root, (cst.Call, cst.Attribute)):
        root = root.func.value if isinstance(root, cst.Call) else root.value
    if not isinstance(root, cst.Name) or root.value not in bound:
        raise Refused(f"attention operand `{code(e)}` is not one of the helper's arguments")
    for s in body:
        if root.value in assigned_names(s):
            value = s.body[0].value if m.matches(s, m.SimpleStatementLine([m.Assign()])) else None
            head = value
            while (
                isinstance(head, cst.Call)
                and isinstance(head.func, cst.Attribute)
                and head.func.attr.value in PASS_THROUGH
            ):
                head = head.func.value
            if not m.matches(head, m.Name(root.value)):
                raise Refused(
                    f"attention operand `{root.value}` recomputed in the helper: `{code(s).strip()}`"
                )
    return e.deep_replace(root, bound[root.value]) if e is not root else bound[root.value]
