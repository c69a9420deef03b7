"""An attention mask that is a score bias per key (Doge's dynamic mask attention: one value per key token and key
head, computed from its values) becomes the runtime `Attention`'s `key_bias=`, cached with the keys:

    attn_mask = self.prepare_dynamic_mask(hidden_states=h, dt_states=dt_states, keep_window_size=self.window)
    attn_mask = repeat_kv(attn_mask, self.num_key_value_groups)
    out, w = attention_interface(self, q, k, v, attention_mask=attn_mask, scaling=self.scaling)
->
    out, w = attention_interface(self, q, k, v, scaling=self.scaling, key_bias=dt_states, keep_keys=self.window)

The mask's builder is a method of the attention class that broadcasts one of its parameters over the query axis
(`bias[:, :, None, :]`, then `.expand(...)` at most) and returns it. It may keep only the keys of the largest bias
once a row holds more than a window (`if mask.shape[-1] > W: ... torch.topk(mask, W, ...)`): that becomes
`keep_keys=W`, which MG005 passes to the `Attention` it builds. The causal mask it combined in HF is gone already
(MG003); the runtime masks causally itself. `repeat_kv` of the mask goes: the runtime's bias is per key head.
A builder that does anything else to the mask is left to MG005, which refuses the `attention_mask=`."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import (
    assigned_names,
    code,
    dotted,
    findall,
    is_docstring,
    kwarg,
    method,
    param_names,
    rewrite_classes,
    with_method,
)
from skills.migrator.rule import Rule
from skills.migrator.rules.runtime_attention import named_argument

PER_KEY = m.Subscript(  # bias[:, :, None, :]
    slice=[
        m.SubscriptElement(m.Slice()),
        m.SubscriptElement(m.Slice()),
        m.SubscriptElement(m.Index(m.Name("None"))),
        m.SubscriptElement(m.Slice()),
    ]
)
COMMA = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
LAST_DIM = m.Subscript(  # mask.shape[-1]
    value=m.Attribute(attr=m.Name("shape")),
    slice=[m.SubscriptElement(m.Index(m.UnaryOperation(m.Minus(), m.Integer("1"))))],
)


def _broadcast(value: cst.BaseExpression) -> cst.BaseExpression | None:
    """bias of `bias[:, :, None, :]` or `bias[:, :, None, :].expand(...)`."""
    if m.matches(value, m.Call(func=m.Attribute(value=PER_KEY, attr=m.Name("expand")))):
        value = value.func.value
    return value.value if m.matches(value, PER_KEY) else None


def _window(s: cst.BaseStatement, mask: str) -> cst.BaseExpression | None:
    """W of `if mask.shape[-1] > W:` whose body keeps `torch.topk(mask, W, ...)` (the largest) of each row."""
    test = s.test if isinstance(s, cst.If) and s.orelse is None else None
    if not m.matches(test, m.Comparison(left=LAST_DIM, comparisons=[m.ComparisonTarget(m.GreaterThan())])):
        return None
    if not m.matches(test.left.value.value, m.Name(mask)):
        return None
    window = test.comparisons[0].comparator
    topk = m.Call(
        func=m.Attribute(m.Name("torch"), m.Name("topk")),
        args=[m.Arg(m.Name(mask)), m.Arg(keyword=None), m.ZeroOrMore()],
    )
    calls = findall(s.body, topk)
    if len(calls) != 1 or code(calls[0].args[1].value) != code(window):
        return None
    largest, dim = kwarg(calls[0], "largest"), kwarg(calls[0], "dim")
    if largest is not None and not m.matches(largest.value, m.Name("True")):
        return None
    return (
        window if dim is None or m.matches(dim.value, m.UnaryOperation(m.Minus(), m.Integer("1"))) else None
    )


def _builder(fn: cst.FunctionDef) -> tuple[str, str | None] | None:
    """(the parameter broadcast as a per-key bias, the parameter or value that is its window, if any) of a method
    that builds and returns such a mask; None if it does anything else to it. Before the broadcast it may only
    bind names of its own (`min_dtype = ...`)."""
    body = [s for s in fn.body.body if not is_docstring(s)]
    mask = bias = window = None
    for s in body:
        line = s.body[0] if isinstance(s, cst.SimpleStatementLine) and len(s.body) == 1 else None
        named = mask is None and m.matches(line, m.Assign([m.AssignTarget(m.Name())]))
        if named and m.matches(b := _broadcast(line.value), m.Name()):
            if b.value not in param_names(fn):
                return None
            mask, bias = line.targets[0].target.value, b.value
            continue
        if mask is None:
            if not named or line.targets[0].target.value in param_names(fn):
                return None
            continue
        if window is None and (w := _window(s, mask)) is not None:
            window = code(w)
            continue
        if m.matches(line, m.Return(m.Name(mask))):
            return (bias, window) if s is body[-1] else None
        if mask in assigned_names(s) or findall(s, m.Name(mask)):
            return None
    return None


def _bound(call: cst.Call, fn: cst.FunctionDef, expr: str) -> str | None:
    """expr of fn's body as its caller `self.fn(...)` would write it: a parameter's argument (its default when the
    call omits it), a number or `self.<attr>` as it is; None for anything else (a local of fn)."""
    static = any(dotted(d.decorator) == "staticmethod" for d in fn.decorators)
    positional = [p.name.value for p in fn.params.params[0 if static else 1 :]]
    param = next((p for p in (*fn.params.params, *fn.params.kwonly_params) if p.name.value == expr), None)
    if param is None:
        value = cst.parse_expression(expr)
        return expr if m.matches(value, m.Integer() | m.Attribute(m.Name("self"), m.Name())) else None
    if arg := kwarg(call, expr):
        return code(arg.value)
    given = [a for a in call.args if a.keyword is None and not a.star]
    if expr in positional and positional.index(expr) < len(given):
        return code(given[positional.index(expr)].value)
    return None if param.default is None else code(param.default)


def _rewrite(cls: cst.ClassDef) -> cst.ClassDef | None:
    if (found := named_argument(cls, "attention_mask")) is None:
        return None
    fwd, line, call, arg = found
    name, doomed, built = arg.value.value, [], None
    for s in reversed(fwd.body.body[: fwd.body.body.index(line)]):
        if name not in assigned_names(s):
            if findall(s, m.Name(name)):
                return None
            continue
        value = s.body[0].value if m.matches(s, m.SimpleStatementLine([m.Assign()])) else None
        doomed.append(s)
        if m.matches(value, m.Call(func=m.Name("repeat_kv"), args=[m.Arg(m.Name(name)), m.ZeroOrMore()])):
            continue
        if not m.matches(value, m.Call(func=m.Attribute(m.Name("self"), m.Name()))):
            return None
        helper = method(cls, value.func.attr.value)
        built = helper and _builder(helper)
        if not built:
            return None
        bias, window = (_bound(value, helper, p) if p else None for p in built)
        break
    if not built or bias is None or (built[1] and window is None):
        return None
    if any(findall(s, m.Name(name)) for s in fwd.body.body[fwd.body.body.index(line) + 1 :]):
        return None  # the mask is read after the call too
    extra = [("key_bias", bias)] + ([("keep_keys", window)] if window else [])
    added = [cst.parse_expression(f"f({k}={v})").args[0].with_changes(comma=COMMA) for k, v in extra]
    kept = [a for a in call.args if a is not arg]
    at = next((i for i, a in enumerate(kept) if a.star), len(kept))  # before `**kwargs`
    if at == len(kept):
        kept[-1] = kept[-1].with_changes(comma=COMMA)
        added[-1] = added[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    args = [*kept[:at], *added, *kept[at:]]
    new_line = line.deep_replace(call, call.with_changes(args=args))
    body = [new_line if s is line else s for s in fwd.body.body if not any(s is d for d in doomed)]
    new_fwd = fwd.with_changes(body=fwd.body.with_changes(body=body))
    return with_method(cls, fwd, new_fwd)


class KeyBiasMask(Rule):
    ID = "MG033"
    DESCRIPTION = "An attention mask that is a score bias per key becomes the runtime Attention's key_bias=."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        return rewrite_classes(module, _rewrite)
