"""Which expressions only compute a value, so that a statement binding one that nothing reads can go: their calls
are torch / math functions, tensor methods that return a new tensor, builtins, predicates (`is_*`, `has_*`), or
functions of the file that only compute themselves. Anything else (a module call, an in-place method, a
collective) is kept."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import findall

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
_MODULE_METHODS = frozenset({"__init__", "forward"})  # building or calling a module does more than compute
_STORE = m.AssignTarget(m.Attribute() | m.Subscript()) | m.AugAssign(target=m.Attribute() | m.Subscript())


def _computes(call: cst.Call, functions: frozenset[str] | set[str]) -> bool:
    f = call.func
    if isinstance(f, cst.Name):  # a predicate (`is_flash_attention_requested(config)`) only answers
        return f.value in BUILTINS or f.value in functions or f.value.startswith(("is_", "has_"))
    if m.matches(f, m.Attribute(value=m.Name("self"))) and f"self.{f.attr.value}" in functions:
        return True  # a method of the file's classes that only computes
    if not isinstance(f, cst.Attribute) or f.attr.value.endswith("_"):
        return False
    if m.matches(f.value, m.OneOf(*map(m.Name, _VALUE_MODULES))):
        return f.attr.value not in _STATEFUL and not f.attr.value.startswith("set_")
    return f.attr.value in TENSOR_METHODS and not m.matches(f.value, _SELF)


def computes_only(e: cst.CSTNode, functions: frozenset[str] | set[str] = frozenset()) -> bool:
    """Evaluating e changes nothing: every call in it only computes (functions: the file's own such)."""
    return not findall(e, m.Await() | m.Yield() | m.NamedExpr()) and all(
        _computes(c, functions) for c in findall(e, m.Call())
    )


def computing_functions(module: cst.Module) -> set[str]:
    """The file's top-level functions whose bodies only compute: locals, arithmetic, calls that only compute; and,
    as `self.<name>`, the methods that do so in every class of the file defining them (a helper building a mask)."""
    bodies: dict[str, list[cst.BaseSuite]] = {}
    for s in module.body:
        if isinstance(s, cst.FunctionDef) and not s.decorators:
            bodies[s.name.value] = [s.body]
        elif isinstance(s, cst.ClassDef):
            for fn in s.body.body:
                if isinstance(fn, cst.FunctionDef) and fn.name.value not in _MODULE_METHODS:
                    bodies.setdefault(f"self.{fn.name.value}", []).append(None if fn.decorators else fn.body)
    found = {
        n for n, bs in bodies.items() if all(b is not None and not findall(b, _EFFECTS | _STORE) for b in bs)
    }
    while True:
        kept = {n for n in found if all(computes_only(b, found) for b in bodies[n])}
        if kept == found:
            return found
        found = kept
