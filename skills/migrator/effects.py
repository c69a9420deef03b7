"""Which expressions only compute a value, so that a statement binding one that nothing reads can go: their calls
are torch / math functions, tensor methods that return a new tensor, builtins, predicates (`is_*`, `has_*`), or
functions of the file that only compute themselves. Anything else (a module call, an in-place method, a
collective) is kept."""

import libcst as cst
import libcst.matchers as m

_VALUE_MODULES = frozenset({"torch", "math", "F"})
_STATEFUL = frozenset(
    {"manual_seed", "seed", "use_deterministic_algorithms"}
)  # torch functions that set state
# tensor methods returning a new value (in-place ones end in `_`); not read off `self`, which may be a module
TENSOR_METHODS = frozenset(
    {
        "abs", "all", "any", "bool", "chunk", "clamp", "clone", "contiguous", "cos", "cumsum", "detach", "dim",
        "eq", "exp", "expand", "expand_as", "flatten", "flip", "float", "ge", "gt", "half", "bfloat16", "int",
        "le", "log", "logical_and", "logical_not", "logical_or", "long", "lt", "masked_fill", "max", "mean",
        "min", "narrow", "ne", "neg", "new_empty", "new_full", "new_ones", "new_zeros", "numel", "permute", "pow",
        "reciprocal", "repeat", "repeat_interleave", "reshape", "rsqrt", "sigmoid", "sin", "size", "split",
        "sqrt", "squeeze", "sum", "t", "tanh", "to", "transpose", "tril", "triu", "type_as", "unflatten",
        "unsqueeze", "view", "view_as",
    }
)  # fmt: skip
BUILTINS = frozenset(
    {"abs", "bool", "float", "int", "isinstance", "len", "list", "max", "min", "range", "round", "tuple"}
)
_SELF = m.Name("self") | m.Attribute(value=m.Name("self"))
_EFFECTS = m.Global() | m.Nonlocal() | m.Del() | m.Yield() | m.Await() | m.FunctionDef() | m.ClassDef()
_STORE = m.AssignTarget(m.Attribute() | m.Subscript()) | m.AugAssign(target=m.Attribute() | m.Subscript())


def _computes(call: cst.Call, functions: frozenset[str] | set[str]) -> bool:
    f = call.func
    if isinstance(f, cst.Name):  # a predicate (`is_flash_attention_requested(config)`) only answers
        return f.value in BUILTINS or f.value in functions or f.value.startswith(("is_", "has_"))
    if not isinstance(f, cst.Attribute) or f.attr.value.endswith("_"):
        return False
    if m.matches(f.value, m.OneOf(*map(m.Name, _VALUE_MODULES))):
        return f.attr.value not in _STATEFUL and not f.attr.value.startswith("set_")
    return f.attr.value in TENSOR_METHODS and not m.matches(f.value, _SELF)


def computes_only(e: cst.CSTNode, functions: frozenset[str] | set[str] = frozenset()) -> bool:
    """Evaluating e changes nothing: every call in it only computes (functions: the file's own such)."""
    return not m.findall(e, m.Await() | m.Yield() | m.NamedExpr()) and all(
        _computes(c, functions) for c in m.findall(e, m.Call())
    )


def computing_functions(module: cst.Module) -> set[str]:
    """The file's top-level functions whose bodies only compute: locals, arithmetic, calls that only compute."""
    defs = {s.name.value: s for s in module.body if isinstance(s, cst.FunctionDef) and not s.decorators}
    found = {n for n, fn in defs.items() if not m.findall(fn.body, _EFFECTS | _STORE)}
    while True:
        kept = {n for n in found if computes_only(defs[n].body, found)}
        if kept == found:
            return found
        found = kept
