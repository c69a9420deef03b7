"""Helpers shared by the parallelize rules: find `self.x = nn.Linear(...)` layers in `__init__`, build the
statements of parallel layers, fuse projection calls in `forward` and put `forward` inside a TPRegion."""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import (
    SELF_ASSIGN_CALL,
    Transformer,
    assigned_names,
    called_name,
    code,
    findall,
    free_names,
    is_docstring,
    kwarg,
    names_in,
    param_names,
    stmt,
)

# transformers' Conv1D(nf, nx) is a linear layer nx -> nf that stores its weight [in, out]
CONV1D = "Conv1D"
LINEAR = frozenset({"nn.Linear", "torch.nn.Linear", CONV1D})
EMBEDDING = frozenset({"nn.Embedding", "torch.nn.Embedding"})
LINEAR_IMPORT = "runtime.layers.linear"
PREFIX_IMPORT = ("runtime.layers.prefix", "join_prefix")
REGION_IMPORTS = [("runtime.layers.token_layout", "TPRegion"), PREFIX_IMPORT]


def arg(call: cst.Call, pos: int, name: str) -> cst.Arg | None:
    """The argument bound to parameter `name` (number `pos` when passed positionally)."""
    if (found := kwarg(call, name)) is not None:
        return found
    positional = [a for a in call.args if a.keyword is None]
    return positional[pos] if pos < len(positional) else None


def plain_args(call: cst.Call, names: Sequence[str]) -> dict[str, str] | None:
    """{parameter: code} when call passes only `names` (positionally in that order, or by keyword), else None."""
    if any(a.star or (a.keyword and a.keyword.value not in names) for a in call.args):
        return None
    if sum(a.keyword is None for a in call.args) > len(names):
        return None
    return {n: code(a.value) for i, n in enumerate(names) if (a := arg(call, i, n)) is not None}


@dataclass(frozen=True)
class LinearArgs:
    in_features: str
    out_features: str
    bias: str  # "True" when not passed, as nn.Linear defaults (the parallel layers default to False)
    transposed: bool = False  # the checkpoint stores the weight [in, out] (Conv1D)

    def layer_args(self, out_features: str | None = None) -> list[str]:
        """A parallel layer's leading arguments: sizes, bias, and how the checkpoint lays the weight out."""
        args = [self.in_features, out_features or self.out_features, f"bias={self.bias}"]
        return args + ["transposed_on_disk=True"] * self.transposed


def linear_args(call: cst.Call) -> LinearArgs | None:
    """nn.Linear's (or Conv1D's) arguments, None when it passes others (device, dtype) a parallel layer can't
    take."""
    if called_name(call) == CONV1D:
        args = plain_args(call, ("nf", "nx"))
        if args is None or len(args) != 2:
            return None
        return LinearArgs(args["nx"], args["nf"], "True", transposed=True)
    args = plain_args(call, ("in_features", "out_features", "bias"))
    if args is None or "in_features" not in args or "out_features" not in args:
        return None
    return LinearArgs(args["in_features"], args["out_features"], args.get("bias", "True"))


@dataclass(frozen=True)
class Layer:
    """`self.<attr> = <call>`, a top-level statement of `__init__`."""

    attr: str
    line: cst.SimpleStatementLine
    call: cst.Call


def self_layers(init: cst.FunctionDef, ctors: Iterable[str]) -> dict[str, Layer]:
    """attr -> Layer for the top-level `self.<attr> = <ctor>(...)` statements of init, ctor one of ctors."""
    ctors = set(ctors)
    found = {}
    for s in init.body.body:
        if m.matches(s, SELF_ASSIGN_CALL) and called_name(s.body[0].value) in ctors:
            attr = s.body[0].targets[0].target.attr.value
            found[attr] = Layer(attr, s, s.body[0].value)
    return found


def self_refs(node: cst.CSTNode, attr: str) -> int:
    """How many times `self.<attr>` appears under node."""
    return len(findall(node, m.Attribute(m.Name("self"), m.Name(attr))))


def plumbed(init: cst.FunctionDef) -> bool:
    """The migrated constructor parameters a parallel layer needs."""
    return {"comm_manager", "prefix"} <= set(param_names(init))


def parallel_layer(
    attr: str, ctor: str, args: Sequence[str], group: str, like: cst.SimpleStatementLine
) -> cst.SimpleStatementLine:
    """`self.<attr> = <ctor>(*args, comm_manager=..., tp_group=group, prefix=...)` in place of `like`."""
    plumbing = ["comm_manager=comm_manager", f'tp_group="{group}"', f'prefix=join_prefix(prefix, "{attr}")']
    new = stmt(f"self.{attr} = {ctor}({', '.join([*args, *plumbing])})\n")
    return new.with_changes(leading_lines=like.leading_lines)


def region(group: str, whole_sequence: bool = False) -> cst.SimpleStatementLine:
    extra = ", whole_sequence=True" if whole_sequence else ""
    return stmt(f'self.tp_region = TPRegion(comm_manager, "{group}"{extra})\n')


def has_region(cls: cst.ClassDef) -> bool:
    """Already rewritten: a class holds at most one TPRegion."""
    return bool(findall(cls, m.AssignTarget(m.Attribute(m.Name("self"), m.Name("tp_region")))))


def edit_body(
    fn: cst.FunctionDef, changes: dict[int, list[cst.BaseStatement]], append: Sequence[cst.BaseStatement] = ()
) -> cst.FunctionDef:
    """fn with each top-level statement whose id() is in changes replaced by its list (empty: removed)."""
    body = [new for s in fn.body.body for new in changes.get(id(s), [s])]
    return fn.with_changes(body=fn.body.with_changes(body=[*body, *append]))


class _ById(Transformer):
    def __init__(self, new: dict[int, cst.CSTNode]) -> None:
        self.new = new

    def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode) -> cst.CSTNode:
        return self.new.get(id(original), updated)


def replace_by_id(node: cst.CSTNode, new: dict[int, cst.CSTNode]) -> cst.CSTNode:
    """node with each node under it whose id() is a key of new replaced by its value (in a block too)."""
    return node.visit(_ById(new))


def replace_classes(module: cst.Module, new: dict[str, cst.ClassDef]) -> cst.Module:
    return module.with_changes(
        body=[new.get(s.name.value, s) if isinstance(s, cst.ClassDef) else s for s in module.body]
    )


def replace_methods(cls: cst.ClassDef, new: dict[str, cst.FunctionDef]) -> cst.ClassDef:
    body = [new.get(s.name.value, s) if isinstance(s, cst.FunctionDef) else s for s in cls.body.body]
    return cls.with_changes(body=cls.body.with_changes(body=body))


class _OwnScope(Transformer):
    """Stays out of nested functions, classes and lambdas: their returns are not forward's."""

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return False

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        return False


class _Returns(_OwnScope):
    def __init__(self):
        self.found: list[cst.Return] = []

    def visit_Return(self, node: cst.Return) -> None:
        self.found.append(node)


def _bound_value(body: Sequence[cst.BaseStatement], name: str) -> cst.BaseExpression | None:
    """The value of `name = <value>` when that is the last top-level statement of body binding name."""
    binders = [s for s in body if name in assigned_names(s)]
    if binders and m.matches(binders[-1], m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name(name))])])):
        return binders[-1].body[0].value
    return None


def returns_output_of(fwd: cst.FunctionDef, attr: str) -> bool:
    """Every return gives `self.<attr>(...)`'s result as is (first element of a tuple), directly or through a
    name that a top-level statement bound to it: the TPRegion's exit sums the row layer's partial outputs,
    which must not have been mixed with replicated values."""
    body = fwd.body.body
    returns = []
    for i, s in enumerate(body):
        s.visit(collect := _Returns())
        returns += [(i, r) for r in collect.found]
    for i, ret in returns:
        value = ret.value.elements[0].value if isinstance(ret.value, cst.Tuple) else ret.value
        if isinstance(value, cst.Name):
            value = _bound_value(body[:i], value.value)
        if value is None or not m.matches(value, m.Call(func=m.Attribute(m.Name("self"), m.Name(attr)))):
            return False
    return bool(returns)


class _CallsToNames(Transformer):
    def __init__(self, names: dict[str, str]):
        self.names = names

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        if m.matches(updated.func, m.Attribute(m.Name("self"))) and updated.func.attr.value in self.names:
            return cst.Name(self.names[updated.func.attr.value])
        return updated


def local_values(fn: cst.FunctionDef) -> dict[str, cst.BaseExpression]:
    """local -> its value, for the locals a top-level line of fn assigns once."""
    lines = [
        s.body[0]
        for s in fn.body.body
        if m.matches(s, m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name())])]))
    ]
    names = [a.targets[0].target.value for a in lines]
    return {n: a.value for n, a in zip(names, lines, strict=True) if names.count(n) == 1}


def _unaliased(fwd: cst.FunctionDef, x: cst.BaseExpression) -> str:
    """x's source, or, for a local forward binds once, and only to another name (BioGPT's `current_states =
    hidden_states`), that name."""
    if isinstance(x, cst.Name) and len(findall(fwd.body, m.AssignTarget(m.Name(x.value)))) == 1:
        value = local_values(fwd).get(x.value)
        if isinstance(value, cst.Name):
            return value.value
    return code(x)


def fuse_calls(fwd: cst.FunctionDef, attrs: Sequence[str], fused: str) -> cst.FunctionDef | str:
    """`self.<attr>(x)` -> `<attr>_out` for each attr, all bound by one statement before the first top-level
    statement that uses them: `<attr>_out, ... = self.<fused>(x).split(self.<fused>.output_partition_sizes,
    dim=-1)`. Returns why not when the calls aren't each made once, on the same input."""
    calls = {a: findall(fwd, m.Call(func=m.Attribute(m.Name("self"), m.Name(a)))) for a in attrs}
    listed = "/".join(attrs)
    if any(len(calls[a]) != 1 or self_refs(fwd, a) != 1 for a in attrs):
        return f"forward does not call each of {listed} exactly once"
    args = [calls[a][0].args for a in attrs]
    if any(len(x) != 1 or x[0].keyword or x[0].star for x in args):
        return f"{listed} are not called with one positional argument"
    inputs = {_unaliased(fwd, x[0].value) for x in args}
    if len(inputs) != 1:
        return f"{listed} are called on different inputs"
    outs = [f"{a}_out" for a in attrs]
    if set(outs) & names_in(fwd):
        return f"forward already uses the names {', '.join(outs)}"
    x = cst.parse_expression(inputs.pop())
    body = fwd.body.body
    holding = [
        i
        for i, s in enumerate(body)
        if any(findall(s, m.Attribute(m.Name("self"), m.Name(a))) for a in attrs)
    ]
    first, last = holding[0], holding[-1]
    simple_last = isinstance(body[last], cst.SimpleStatementLine) and len(body[last].body) == 1
    if any(assigned_names(s) & free_names(x) for s in body[first : last if simple_last else last + 1]):
        return f"the input of {listed} changes between or before their calls"
    split = stmt(
        f"{', '.join(outs)} = self.{fused}({code(x)}).split(self.{fused}.output_partition_sizes, dim=-1)\n"
    )
    new = fwd.visit(_CallsToNames(dict(zip(attrs, outs, strict=True))))
    body = list(new.body.body)
    body.insert(first, split.with_changes(leading_lines=body[first].leading_lines))
    body[first + 1] = body[first + 1].with_changes(leading_lines=[])
    return new.with_changes(body=new.body.with_changes(body=body))


class _ExitOnReturn(_OwnScope):
    def leave_Return(self, original: cst.Return, updated: cst.Return) -> cst.Return:
        def exit_(value: cst.BaseExpression) -> cst.Call:
            return cst.Call(cst.parse_expression("self.tp_region.exit"), [cst.Arg(value)])

        value = updated.value
        if value is None:
            return updated
        if isinstance(value, cst.Tuple) and value.elements:
            first = value.elements[0]
            elements = [first.with_changes(value=exit_(first.value)), *value.elements[1:]]
            return updated.with_changes(value=value.with_changes(elements=elements))
        return updated.with_changes(value=exit_(value))


def exit_point(fwd: cst.FunctionDef, attr: str) -> int | None:
    """Index of forward's top-level statement `name = self.<attr>(...)` (its only call of the layer) after which
    forward reads only name, what it binds from there on and its other arguments (BLOOM adds the residual it is
    given): the TPRegion can sum the partial outputs there, and the rest runs once on the sums, in the rank's own
    token layout like those arguments."""
    body = fwd.body.body
    bound = bound_call(body, attr)
    if bound is None or self_refs(fwd, attr) != 1 or len(param_names(fwd)) < 2:
        return None
    at, name = bound
    earlier = set().union(*(assigned_names(s) for s in body[:at]), {param_names(fwd)[1]}) - {name}
    return None if free_names(cst.Module(body[at + 1 :]), data_only=True) & earlier else at


def wrap_region(fwd: cst.FunctionDef, exit_at: int | None = None) -> cst.FunctionDef | None:
    """forward starting with `<hidden> = self.tp_region.enter(<hidden>)` (hidden: its first argument) and
    returning `self.tp_region.exit(...)`, or exiting at the value of its statement exit_at (see exit_point); None
    when forward takes no positional argument after self."""
    return enter_region(exit_region(fwd, exit_at))


def enter_region(fwd: cst.FunctionDef) -> cst.FunctionDef | None:
    """forward starting with `<hidden> = self.tp_region.enter(<hidden>)`, hidden its first argument; None when
    it takes none after self."""
    params = [*fwd.params.posonly_params, *fwd.params.params]
    if len(params) < 2 or not isinstance(fwd.body, cst.IndentedBlock):
        return None
    hidden = params[1].name.value
    body = list(fwd.body.body)
    body.insert(1 if is_docstring(body[0]) else 0, stmt(f"{hidden} = self.tp_region.enter({hidden})\n"))
    return fwd.with_changes(body=fwd.body.with_changes(body=body))


def exit_region(fwd: cst.FunctionDef, exit_at: int | None = None) -> cst.FunctionDef:
    """forward returning `self.tp_region.exit(...)`, or exiting at the value of its statement exit_at (see
    exit_point)."""
    body = list(fwd.body.body)
    if exit_at is None:
        return fwd.with_changes(body=fwd.body.with_changes(body=[s.visit(_ExitOnReturn()) for s in body]))
    assign = body[exit_at].body[0]
    value = cst.Call(cst.parse_expression("self.tp_region.exit"), [cst.Arg(assign.value)])
    body[exit_at] = body[exit_at].with_changes(body=[assign.with_changes(value=value)])
    return fwd.with_changes(body=fwd.body.with_changes(body=body))


def _block_slice(s: cst.BaseStatement, x: str) -> tuple[str, str | None, str | None] | None:
    """(target, lower, upper) of `target = x[..., lower:upper]` (bounds as code, None when open)."""
    pattern = m.SimpleStatementLine(
        [
            m.Assign(
                [m.AssignTarget(m.Name())],
                m.Subscript(
                    m.Name(x),
                    [m.SubscriptElement(m.Index(m.Ellipsis())), m.SubscriptElement(m.Slice(step=None))],
                ),
            )
        ]
    )
    if not m.matches(s, pattern):
        return None
    assign = s.body[0]
    cut = assign.value.slice[1].slice
    return assign.targets[0].target.value, *(None if b is None else code(b) for b in (cut.lower, cut.upper))


def bound_call(body: Sequence[cst.BaseStatement], attr: str) -> tuple[int, str] | None:
    """(index, name) of the first top-level statement `name = self.<attr>(...)` of body."""
    call = m.Call(func=m.Attribute(m.Name("self"), m.Name(attr)))
    bound = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name())], call)])
    return next(
        ((i, s.body[0].targets[0].target.value) for i, s in enumerate(body) if m.matches(s, bound)), None
    )


# methods that act on each element alone: the blocks of a fused output stay where they are
ELEMENTWISE = ("clamp", "clip", "float", "to", "contiguous")


def _elementwise_update(s: cst.BaseStatement, x: str) -> bool:
    """`x = x.clamp(...)` (an ELEMENTWISE method whose arguments do not read x), alone or as the whole body of an
    `if` without else whose test does not read x (MPT's `if self.clip_qkv:`)."""
    call = m.Call(m.Attribute(m.Name(x), m.OneOf(*map(m.Name, ELEMENTWISE))))
    update = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name(x))], call)])
    if isinstance(s, cst.If):
        body = s.body.body
        return (
            s.orelse is None
            and not findall(s.test, m.Name(x))
            and all(_elementwise_update(b, x) for b in body)
        )
    return m.matches(s, update) and len(findall(s, m.Name(x))) == 2


def _chunked(s: cst.BaseStatement, x: m.BaseExpression, parts: int) -> tuple[str, str] | None:
    """(targets, dim) of `a, b, c = x.chunk(parts, dim=d)` (or `x.chunk(parts, d)`), or of `a, b, c = x.split(n,
    d)`: `parts` consecutive blocks of dim d whatever the sizes n (unpacking into as many names checks the count)."""
    chunk = m.Call(m.Attribute(x, m.Name("chunk")), [m.Arg(m.Integer(str(parts))), m.Arg()])
    cut = chunk | m.Call(m.Attribute(x, m.Name("split")), [m.Arg(keyword=None), m.Arg()])
    line = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Tuple())], cut)])
    if not m.matches(s, line):
        return None
    assign = s.body[0]
    dim = assign.value.args[1]
    if (dim.keyword is not None and dim.keyword.value != "dim") or len(
        assign.targets[0].target.elements
    ) != parts:
        return None
    return code(assign.targets[0].target), code(dim.value)


def split_fused_output(fwd: cst.FunctionDef, attr: str, parts: int) -> cst.FunctionDef | str:
    """forward cutting `x = self.<attr>(...)` into `parts` consecutive blocks of its last dim (`a = x[..., :p]`,
    `b = x[..., p:q]`, `c = x[..., q:]`, whose bounds are whole-model sizes, or `a, b, c = x.chunk(parts, dim)` /
    `x.split(n, dim)`, equal blocks, x maybe the call itself, or it given a leading axis by `.unsqueeze(k)`), maybe
    after element-wise updates of x, made to split it by the parallel layer's per-rank sizes instead: `a, b, c =
    x.split(self.<attr>.output_partition_sizes, dim=-1)`. Locals only those bounds read go too. Returns why not
    when the output is used any other way."""
    body = list(fwd.body.body)

    def split_at(i: int, targets: str, dim: str) -> cst.FunctionDef:
        """`targets = <receiver>.chunk(n, dim)` / `.split(n, dim)` -> `.split(<per-rank sizes>, dim)`, the
        receiver kept as written (it may span lines inside parentheses)."""
        assign = body[i].body[0]
        args = cst.parse_expression(f"x.split(self.{attr}.output_partition_sizes, dim={dim})").args
        func = assign.value.func.with_changes(attr=cst.Name("split"))
        split = assign.value.with_changes(func=func, args=args)
        target = cst.AssignTarget(cst.parse_expression(targets))
        body[i] = body[i].with_changes(body=[assign.with_changes(targets=[target], value=split)])
        return fwd.with_changes(body=fwd.body.with_changes(body=body))

    own = m.Call(m.Attribute(m.Name("self"), m.Name(attr)))
    # GPT-BigCode adds a head axis first: `self.c_attn(h).unsqueeze(1).split((q, kv, kv), dim=3)`
    own |= m.Call(m.Attribute(own, m.Name("unsqueeze")), [m.Arg(m.Integer())])
    inline = [(i, c) for i, s in enumerate(body) if (c := _chunked(s, own, parts))]
    if len(inline) == 1 and self_refs(fwd, attr) == 1:  # `a, b, c = self.<attr>(h).split(n, dim=-1)`
        return split_at(inline[0][0], *inline[0][1])
    bound = bound_call(body, attr)
    if bound is None or self_refs(fwd, attr) != 1:
        return f"forward does not bind `self.{attr}(...)`'s output to a name once"
    at, x = bound
    later = [s for s in body[at + 1 :] if not _elementwise_update(s, x)]
    uses = sum(len(findall(s, m.Name(x))) for s in later)
    rebound = any(x in assigned_names(s) for s in later)  # later reads would not be of the layer's output
    chunks = [(i, c) for i, s in enumerate(body) if (c := _chunked(s, m.Name(x), parts))]
    if len(chunks) == 1 and uses == 1 and not rebound:
        return split_at(chunks[0][0], *chunks[0][1])
    cuts = [(i, c) for i, s in enumerate(body) if (c := _block_slice(s, x))]
    bounds = [b for _, c in cuts for b in c[1:]]
    consecutive = bounds[:1] == [None] and bounds[-1:] == [None] and bounds[1:-1:2] == bounds[2:-1:2]
    if len(cuts) != parts or uses != parts or not consecutive or rebound:
        return f"forward uses `self.{attr}`'s output other than as {parts} consecutive slices of its last dim"
    targets = ", ".join(c[0] for _, c in cuts)
    split = stmt(f"{targets} = {x}.split(self.{attr}.output_partition_sizes, dim=-1)\n")
    first = cuts[0][0]
    body[first] = split.with_changes(leading_lines=body[first].leading_lines)
    dropped = {i for i, _ in cuts[1:]}
    body = [s for i, s in enumerate(body) if i not in dropped]
    read = set().union(*(free_names(cst.parse_expression(b)) for b in bounds if b))
    return drop_unused_locals(fwd.with_changes(body=fwd.body.with_changes(body=body)), read)


def drop_unused_locals(fn: cst.FunctionDef, names: Iterable[str]) -> cst.FunctionDef:
    """fn without the top-level `name = ...` of each of names that nothing reads any more, nor a top-level `if`
    chain whose branches do nothing but bind it (Falcon's `qkv_out_dim` per layout)."""
    body = list(fn.body.body)
    for name in names:
        binding = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name(name))])])
        binders = [s for s in body if name in assigned_names(s)]
        if (
            len(binders) == 1
            and (m.matches(binders[0], binding) or _only_binds(binders[0], binding))
            and len(findall(cst.Module(body), m.Name(name)))
            == len(findall(binders[0], m.AssignTarget(m.Name(name))))
        ):
            body = [s for s in body if s is not binders[0]]
    return fn.with_changes(body=fn.body.with_changes(body=body))


def _only_binds(s: cst.BaseStatement, binding: m.BaseMatcherNode) -> bool:
    """s is an if / elif / else chain each branch of which is one statement matching binding, its tests pure."""
    while isinstance(s, cst.If):
        if len(s.body.body) != 1 or not m.matches(s.body.body[0], binding) or findall(s.test, m.Call()):
            return False
        s = s.orelse
    return s is None or (len(s.body.body) == 1 and m.matches(s.body.body[0], binding))
