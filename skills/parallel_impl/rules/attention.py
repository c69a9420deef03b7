"""Attention is sharded by heads in attn_tp_group: q_proj/k_proj/v_proj become one QKVParallelLinear
`qkv_proj`, o_proj a RowParallelLinear whose partial sums the class's TPRegion reduces on the way out, and
the runtime `Attention` gets the per-rank head counts (which also size this rank's KV cache). A per-head
parameter it receives as `sinks=`, or broadcasts along the head axis, keeps this rank's heads (`shard_heads`);
another linear whose output counts the query heads (an output gate per head or per head channel) is split by
heads like q_proj; a module applied to all heads' q or k projection output (OLMo2's q_norm / k_norm) runs on
every head (`gather_heads`). Every runtime `Attention` a class builds with the same head counts gets them (Falcon's
rotary and ALiBi layers on one cache), provided forward runs only one. Attention whose output projection lives in
the module its output is handed to (BERT's SelfOutput, see _split_unit) returns its heads' share, which that
module's RowParallelLinear sums.

Attention left as it is would see only a rank's share of the tokens under TP+DP, so an attention class this rule
can't rewrite is a finding; with `--replicate-attention` (ctx.replicate_attention) it runs whole on every rank
instead, in a ReplicatedRegion that gathers its DP rank's tokens and keeps this rank's rows."""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from itertools import pairwise
from typing import TYPE_CHECKING

import libcst as cst
import libcst.matchers as m

from skills.migrator.call_sites import bound_parameter
from skills.migrator.cst_utils import (
    appended,
    assigned_names,
    called_name,
    classes,
    findall,
    free_names,
    kwarg,
    method,
    operand,
    param_names,
    pure,
    stmt,
    substituted,
)
from skills.migrator.rule import Rule
from skills.migrator.rules.checkpoint_branches import checkpoint_value, is_guard
from skills.parallel_impl.rules._split_unit import Closer, closed, closing_half
from skills.parallel_impl.rules._units import (
    LINEAR,
    LINEAR_IMPORT,
    REGION_IMPORTS,
    Layer,
    LinearArgs,
    arg,
    bound_call,
    code,
    drop_unused_locals,
    edit_body,
    enter_region,
    exit_point,
    fuse_calls,
    has_region,
    linear_args,
    local_values,
    parallel_layer,
    plumbed,
    region,
    replace_by_id,
    replace_classes,
    replace_methods,
    returns_output_of,
    self_layers,
    self_refs,
    split_fused_output,
    wrap_region,
)

if TYPE_CHECKING:
    from skills.parallel_impl.rewrite import ParallelRewriteContext

GROUP = "attn_tp_group"
OPROJ_GROUP = "oproj_tp_group"
QKV = ("q_proj", "k_proj", "v_proj")
OUT = ("o_proj", "out_proj", "dense")
FUSED_ON_DISK = ("qkv_proj", "query_key_value", "c_attn", "Wqkv", "W_pack", "qkv")
# head counts as configs and attention classes name them
HEADS = ("num_attention_heads", "num_key_value_heads", "num_heads", "num_kv_heads")
# widths of all heads side by side, as attention classes name them
WIDTHS = ("embed_dim", "hidden_size", "all_head_size")
# forward code that would mean whole-model head counts / widths, which a rank no longer has
GLOBAL_SIZES = re.compile(rf"\b({'|'.join(HEADS)}|n_heads|n_head|hidden_size|embed_dim|all_head_size)\b")


# a module or parameter built in __init__ with these is sized for every head, not a rank's share
HEAD_COUNTS = re.compile(rf"\b({'|'.join(HEADS)})\b")
QUERY_HEADS = ("num_attention_heads", "num_heads", "n_heads", "n_head")
KV_HEADS = {"num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head", "kv_heads"}
# heads per key head, plus its key and value (Falcon's grouped `self.num_heads // self.num_kv_heads + 2`): the same on
# every rank whose rows are whole groups, which __init__ then checks (whole_blocks)
_PER_KEY_HEAD = m.BinaryOperation(
    m.Attribute(m.Name("self"), m.OneOf(*map(m.Name, QUERY_HEADS))),
    m.FloorDivide(),
    m.Attribute(m.Name("self"), m.OneOf(*map(m.Name, KV_HEADS))),
)
PER_GROUP = _PER_KEY_HEAD | m.BinaryOperation(_PER_KEY_HEAD, m.Add(), m.Integer())
# the runtime Attention's head-count arguments: (position, keyword)
HEAD_ARGS = ((0, "num_heads"), (3, "num_kv_heads"))
# head counts a method other than __init__ may read as `self.<attr>`: they size the activations a rank holds
HEAD_ATTRS = re.compile("|".join((*HEADS, "n_heads", "n_head")))


def _head_attrs(fns: list[cst.FunctionDef], init: cst.FunctionDef, counts: Collection[str] = ()) -> list[str]:
    """The head counts `self.x` that fns (the methods other than __init__) read and __init__ sets once, by a
    top-level `self.x = ...` line: they become this rank's share at the end of __init__ (what __init__ built from
    them is sized for the whole model and sharded by its layer). A head count is named as one, or is what the
    Attention call was given as a head count (counts: their source), under whatever name (ChatGLM's
    `num_multi_query_groups_per_partition`)."""
    found = []
    for fn in fns:
        for node in findall(fn, m.Attribute(m.Name("self"), m.Name())):
            attr = node.attr.value
            if attr in found or (value := _set_once(init, attr)) is None:
                continue
            given = f"self.{attr}" in counts or (code(value) in counts and not isinstance(value, cst.Integer))
            if HEAD_ATTRS.fullmatch(attr) or given:  # not any attribute set to a multi-query layer's `1`
                found.append(attr)
    return found


def _attention_head_counts(init: cst.FunctionDef, attention: list[Layer]) -> list[str]:
    """Sources of the head counts the runtime Attention layers are given, and of the values __init__ sets the
    attributes among them to once (`num_heads=self.n_local_heads`, `self.n_local_heads = args.n_heads`)."""
    counts = []
    for layer in attention:
        for pos, name in HEAD_ARGS:
            if (given := arg(layer.call, pos, name)) is None:
                continue
            counts.append(code(given.value))
            own = m.matches(given.value, m.Attribute(m.Name("self"), m.Name()))
            if own and (value := _set_once(init, given.value.attr.value)) is not None:
                counts.append(code(value))
    return counts


def _reads_any(node: cst.CSTNode, sources: Collection[str]) -> bool:
    """node reads one of the expressions sources (as written), whole: `args.n_heads` in `args.n_heads * d`."""
    return any(code(e) in sources for e in findall(node, m.Attribute() | m.Name()))


def _set_once(init: cst.FunctionDef, attr: str) -> cst.BaseExpression | None:
    """The value of the one top-level `self.<attr> = value` line of __init__ that sets attr, if only it does."""
    target = m.Attribute(m.Name("self"), m.Name(attr))
    setters = [s for s in init.body.body if findall(s, m.AssignTarget(target) | m.AugAssign(target))]
    line = m.SimpleStatementLine([m.Assign([m.AssignTarget(target)])])
    return setters[0].body[0].value if len(setters) == 1 and m.matches(setters[0], line) else None


def _counts_query_heads(value: cst.BaseExpression, queries: str) -> bool:
    """value is the query heads' count: the Attention layer's source of it, or a field named as one
    (`config.num_attention_heads`); not the key heads', which ranks may hold copies of."""
    named = m.Attribute(attr=m.OneOf(*map(m.Name, QUERY_HEADS)))
    return code(value) == queries or m.matches(value, named)


def _localized(
    attrs: list[str], share: dict[str, str], widths: Collection[str] = ()
) -> list[cst.SimpleStatementLine]:
    """`self.x = <this rank's share of x>` for each head count or output width x (of widths, or named as one):
    share[x], else local_heads of a head count, local_width of a width."""
    lines = []
    for a in attrs:
        width = a in WIDTHS or a in widths
        helper = "local_width" if width else "local_kv_heads" if a in KV_HEADS else "local_heads"
        value = share.get(a) or f'{helper}(self.{a}, comm_manager, "{GROUP}")'
        lines.append(stmt(f"self.{a} = {value}\n"))
    return lines


def _output_widths(
    methods: list[cst.FunctionDef],
    init: cst.FunctionDef,
    fwd: cst.FunctionDef,
    out: str | None,
    queries: str = "",
) -> list[str]:
    """The widths `self.x` (WIDTHS, set once in __init__) that the methods other than __init__ read only in
    forward between its runtime Attention call and its output projection's input (its return without one): the
    width of the attention output, to which XGLM's `attn_output.reshape(bsz, tgt_len, self.embed_dim)` brings the
    heads, and of which a rank holds its heads' share."""
    found = _attention_call(init, fwd)
    if found is None:
        return []
    body = fwd.body.body
    if out is None:
        between = body[found[0] + 1 :]
    else:
        out_call = m.Call(m.Attribute(m.Name("self"), m.Name(out)))
        last = next((i for i, s in enumerate(body) if findall(s, out_call)), None)
        if last is None or last <= found[0]:
            return []
        between = [*body[found[0] + 1 : last], *(a for c in findall(body[last], out_call) for a in c.args)]
    read = m.Attribute(m.Name("self"), m.Name())
    inside = {id(n) for s in between for n in findall(s, read)}
    widths = []
    for attr in dict.fromkeys([*WIDTHS, *(n.attr.value for s in between for n in findall(s, read))]):
        reads = [n for f in methods for n in findall(f, m.Attribute(m.Name("self"), m.Name(attr)))]
        if not reads or not all(id(n) in inside for n in reads) or (value := _set_once(init, attr)) is None:
            continue
        product = m.matches(value, m.BinaryOperation(operator=m.Multiply())) and any(
            _counts_query_heads(side, queries) for side in (value.left, value.right)
        )
        if attr in WIDTHS or product:  # ChatGLM's `projection_size = kv_channels * num_attention_heads`
            widths.append(attr)
    return widths


def _input_width(fwd: cst.FunctionDef) -> str | None:
    """The local forward unpacks its hidden-states input's width into: `embed_dim` of BART-style attention's
    `bsz, tgt_len, embed_dim = hidden_states.size()`."""
    params = [p.name.value for p in fwd.params.params if p.name.value != "self"]
    if not params:
        return None
    hidden = m.Name(params[0])
    size = m.Call(m.Attribute(hidden, m.Name("size")), []) | m.Attribute(hidden, m.Name("shape"))
    unpack = m.Assign([m.AssignTarget(m.Tuple([m.AtLeastN(m.Element(m.Name()), n=2)]))], size)
    found = [a for s in fwd.body.body if m.matches(s, m.SimpleStatementLine([unpack])) for a in s.body]
    return found[0].targets[0].target.elements[-1].value.value if len(found) == 1 else None


def _rank_width(init: cst.FunctionDef, fwd: cst.FunctionDef) -> cst.FunctionDef | str:
    """forward with the input's width (see _input_width) that sizes the attention output (read after the runtime
    Attention call) left for reshape / view to infer, `-1`: a rank's output holds only its heads' share of it."""
    width, found = _input_width(fwd), _attention_call(init, fwd)
    if width is None or found is None:
        return fwd
    fwd = _per_head_views(fwd, width, found[0])
    if isinstance(fwd, str):
        return fwd
    after = fwd.body.body[found[0] :]
    reads = [n for s in after for n in findall(s, m.Name(width))]
    if not reads:
        return fwd
    resize = m.Call(m.Attribute(attr=m.Name("reshape") | m.Name("view")))
    calls = [
        c for s in after for c in findall(s, resize) if any(m.matches(a.value, m.Name(width)) for a in c.args)
    ]
    inferred = m.UnaryOperation(m.Minus(), m.Integer("1"))
    direct = {id(a.value) for c in calls for a in c.args if m.matches(a.value, m.Name(width))}
    if {id(n) for n in reads} != direct or any(
        sum(m.matches(a.value, m.Name(width) | inferred) for a in c.args) != 1 for c in calls
    ):
        return f"forward sizes the attention output by its input's width `{width}`, which a rank holds a share of"
    minus_one = cst.parse_expression("-1")
    changes = {
        c: c.with_changes(
            args=[a.with_changes(value=minus_one) if id(a.value) in direct else a for a in c.args]
        )
        for c in calls
    }
    for old, new in changes.items():
        fwd = fwd.deep_replace(old, new)
    return fwd


def _per_head_views(fwd: cst.FunctionDef, width: str, stop: int) -> cst.FunctionDef | str:
    """forward with the head size its views compute from the input's width before the attention call (nanoGPT's
    `q.view(B, T, self.n_head, C // self.n_head)`) left for view / reshape to infer, `-1`: the width stays whole
    on every rank while the head count becomes this rank's."""
    per_head = m.BinaryOperation(m.Name(width), m.FloorDivide())
    before = fwd.body.body[:stop]
    splits = [e for s in before for e in findall(s, per_head)]
    if not splits:
        return fwd
    resize = m.Call(m.Attribute(attr=m.Name("reshape") | m.Name("view")))
    inferred = m.UnaryOperation(m.Minus(), m.Integer("1"))
    calls = [
        c for s in before for c in findall(s, resize) if any(m.matches(a.value, per_head) for a in c.args)
    ]
    in_calls = {id(a.value) for c in calls for a in c.args if m.matches(a.value, per_head)}
    if {id(e) for e in splits} != in_calls or any(
        sum(m.matches(a.value, per_head | inferred) for a in c.args) != 1 for c in calls
    ):
        return f"forward sizes heads by its input's width `{width}` (`{code(splits[0])}`), which a rank does not divide"
    minus_one = cst.parse_expression("-1")
    return replace_by_id(
        fwd,
        {
            id(c): c.with_changes(
                args=[a.with_changes(value=minus_one) if id(a.value) in in_calls else a for a in c.args]
            )
            for c in calls
        },
    )


def _whole_head_module(init: cst.FunctionDef, skip: list[cst.BaseStatement]) -> str | None:
    """Source of the first other line of __init__ (in a block too) that builds a module / parameter from the head
    counts, also through a local set from them (`g_proj_dim = self.num_heads`); an exception it raises is
    neither."""
    skipped = {id(c) for s in skip for c in findall(s, m.Call())}
    values = local_values(init)
    for line in findall(init.body, m.SimpleStatementLine()):
        raised = {id(c) for r in findall(line, m.Raise()) for c in findall(r, m.Call())}
        calls = [c for c in findall(line, m.Call()) if id(c) not in raised | skipped]
        if any(builds_from_heads(c, values) for c in calls):
            return code(line).strip()
    return None


def builds_from_heads(call: cst.Call, values: dict[str, cst.BaseExpression] | None = None) -> bool:
    """call builds a module (a capitalised callee) or a Parameter sized by the head counts, read directly or
    through the locals values holds."""
    callee = called_name(call).split(".")[-1]
    if not (callee[:1].isupper() or callee == "Parameter"):
        return False
    read = {n.value for n in findall(call, m.Name())} & (values or {}).keys()
    return counts_heads(call) or any(counts_heads(values[n]) for n in read)


def counts_heads(node: cst.CSTNode) -> bool:
    """Whether node reads a head count other than as a divisor (`hidden_size // num_heads` is one head's size)."""
    divide = m.BinaryOperation(operator=m.FloorDivide() | m.Divide())
    divisors = {id(n) for d in findall(node, divide) for n in findall(d.right, m.Name())}
    return any(HEAD_COUNTS.fullmatch(n.value) and id(n) not in divisors for n in findall(node, m.Name()))


def _per_head_params(
    cls: cst.ClassDef, init: cst.FunctionDef, fwd: cst.FunctionDef, q_heads: str
) -> dict[int, str]:
    """id() of each __init__ line `self.x = ...` whose value forward uses only per query head -> x: as
    `sinks=self.x` (GPT-OSS), or, built from the query head count q_heads, broadcast along the head axis as
    `self.x[None, :, None]` (a gate bias per head)."""
    sink = m.Arg(keyword=m.Name("sinks"), value=m.Attribute(m.Name("self"), m.Name()))
    sinks = {a.value.attr.value for a in findall(fwd, sink)}
    broadcast = set()
    for sub in findall(fwd, m.Subscript(m.Attribute(m.Name("self"), m.Name()))):
        slices = [e.slice for e in sub.slice]
        full = [x for x in slices if m.matches(x, m.Slice(lower=None, upper=None, step=None))]
        if len(full) == 1 and all(x is full[0] or m.matches(x, m.Index(m.Name("None"))) for x in slices):
            broadcast.add(sub.value.attr.value)
    found = {}
    for s in init.body.body:
        target = m.AssignTarget(m.Attribute(m.Name("self"), m.Name()))
        if not m.matches(s, m.SimpleStatementLine([m.Assign([target])])):
            continue
        a, value = s.body[0].targets[0].target.attr.value, code(s.body[0].value)
        per_head = a in sinks or (a in broadcast and re.search(rf"\b{re.escape(q_heads)}\b", value))
        if per_head and self_refs(cls, a) == 2:
            found[id(s)] = a
    return found


def _all_head_modules(
    init: cst.FunctionDef, fwd: cst.FunctionDef, cls: cst.ClassDef, qk: Sequence[str], out: str | None
) -> dict[int, tuple[str, str]]:
    """id() of each __init__ line `self.x = Module(...)` whose module forward applies only to the whole output of
    the q or k projection qk names (`self.x(self.q_proj(h))`: "q" or "k"), or to the whole input of the output
    projection (BitNet's `attn_sub_norm` over every head's output: "o") -> (x, kind)."""
    found = {}
    for s in init.body.body:
        target = m.SimpleStatementLine(
            [m.Assign([m.AssignTarget(m.Attribute(m.Name("self"), m.Name()))], m.Call())]
        )
        if not m.matches(s, target):
            continue
        attr = s.body[0].targets[0].target.attr.value
        if self_refs(cls, attr) != 2:
            continue
        for proj, kind in zip(qk, "qk", strict=True):
            applied = m.Call(
                m.Attribute(m.Name("self"), m.Name(attr)),
                [m.Arg(m.Call(m.Attribute(m.Name("self"), m.Name(proj))))],
            )
            if len(findall(fwd, applied)) == 1:
                found[id(s)] = (attr, kind)
        if out and _feeds(fwd, attr, out):
            found[id(s)] = (attr, "o")
    return found


def _feeds(fwd: cst.FunctionDef, attr: str, out: str) -> bool:
    """forward gives `self.<attr>(...)`'s result whole to `self.<out>`: `self.<out>(self.<attr>(x))`, or
    `y = self.<attr>(x)` followed by a statement calling `self.<out>(y)`."""
    call = m.Call(m.Attribute(m.Name("self"), m.Name(attr)))
    if findall(fwd, m.Call(m.Attribute(m.Name("self"), m.Name(out)), [m.Arg(call)])):
        return True
    body = fwd.body.body
    bound = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name())], call)])
    for s, after in pairwise(body):
        if m.matches(s, bound):
            y = s.body[0].targets[0].target.value
            if findall(after, m.Call(m.Attribute(m.Name("self"), m.Name(out)), [m.Arg(m.Name(y))])):
                return True
    return False


def _head_gates(
    cls: cst.ClassDef, init: cst.FunctionDef, linears: dict[str, Layer], taken: Sequence[str], q_heads: str
) -> dict[str, LinearArgs]:
    """attr -> arguments of each other linear, which forward calls once, whose output size counts the query heads
    (q_heads, or another name for them) and no key heads, directly or through a local: an output gate per query
    head (Laguna's `g_proj`) or per query-head channel (AFMoE's `gate_proj`), whose rows are the query heads',
    split by heads like q_proj's."""
    values = local_values(init)
    query = {*QUERY_HEADS, *(n.value for n in findall(cst.parse_expression(q_heads), m.Name()))}
    found = {}
    for attr, layer in linears.items():
        args = linear_args(layer.call)
        if attr in taken or args is None or self_refs(cls, attr) != 2:
            continue
        size = cst.parse_expression(args.out_features)
        read = {n.value for n in findall(size, m.Name())}
        read |= {x.value for n in read & values.keys() for x in findall(values[n], m.Name())}
        if read & query and not read & KV_HEADS:
            found[attr] = args
    return found


def _head_args(call: cst.Call) -> tuple[str | None, ...]:
    """The head counts and head size an `Attention(...)` call passes, as code."""
    given = (arg(call, 0, "num_heads"), arg(call, 1, "head_dim"), arg(call, 3, "num_kv_heads"))
    return tuple(code(a.value) if a is not None else None for a in given)


def _attention_layers_refused(attention: list[Layer], fwd: cst.FunctionDef, groups: int = 1) -> str | None:
    """Why the runtime Attention layers cannot all take a rank's heads: none, several with different head counts,
    or several that forward runs, unless in as many runs of heads (groups, as _head_groups finds them)."""
    if len({_head_args(a.call) for a in attention}) != 1:
        return "__init__ builds no runtime `Attention(...)` layer, or several with different head counts"
    run = _layers_run(attention, fwd)
    if len(run) > 1 and groups != len(run):
        return f"forward runs {len(run)} runtime Attention layers (`{'`, `'.join(run)}`), whose heads it may combine"
    return None


def _layers_run(attention: list[Layer], fwd: cst.FunctionDef) -> list[str]:
    """The runtime Attention layers forward calls."""
    return [a.attr for a in attention if findall(fwd, _calls_layer(a.attr))]


def _head_groups(fwd: cst.FunctionDef) -> int:
    """n when forward chunks tensors into n parts, every `torch.chunk` / `.chunk` call of it into the same literal
    n >= 2 (DiffLlama runs two softmaxes over one q / k and pairs head h with h + H/2: with as many Attention
    layers run, the heads form n runs a rank needs its share of each of, QKVParallelLinear's ``head_groups``;
    `skill parallelize` verifies the result against transformers); else 1."""
    chunk = m.Call(m.Attribute(m.Name("torch"), m.Name("chunk")) | m.Attribute(attr=m.Name("chunk")))
    counts = set()
    for c in findall(fwd, chunk):
        n = arg(c, 1 if m.matches(c.func.value, m.Name("torch")) else 0, "chunks")
        counts.add(int(n.value.value) if n is not None and isinstance(n.value, cst.Integer) else 0)
    return counts.pop() if len(counts) == 1 and min(counts) >= 2 else 1


def _calls_layer(*attrs: str) -> m.Call:
    """A call of `self.<attr>`, one of attrs, or of one of its entry points (`self.attn.forward_heads_first(...)`)."""
    layer = m.Attribute(m.Name("self"), m.OneOf(*map(m.Name, attrs)))
    return m.Call(layer | m.Attribute(layer))


def _attention_call(init: cst.FunctionDef, fwd: cst.FunctionDef | None) -> tuple[int, cst.Call] | None:
    """(the index of forward's first top-level statement that calls one of the class's runtime Attention layers, or
    one of their entry points such as `forward_heads_first`, that call)."""
    attention = list(self_layers(init, {"Attention"}))
    if fwd is None or not attention:
        return None
    attend = _calls_layer(*attention)
    for i, s in enumerate(fwd.body.body):
        if calls := findall(s, attend):
            return i, calls[0]
    return None


# methods that only lay a tensor out anew: applied to the attention output, a rank's heads stay its own
RELAYOUT = ("reshape", "view", "transpose", "permute", "flatten", "contiguous")


def _relaid_only_after_attention(init: cst.FunctionDef, fwd: cst.FunctionDef | None) -> bool:
    """forward only lays the runtime Attention's output out anew after it (RELAYOUT): nothing that could mix the
    heads, which a rank holds its share of."""
    if (found := _attention_call(init, fwd)) is None:
        return False
    relayout = m.Call(m.Attribute(attr=m.OneOf(*map(m.Name, RELAYOUT))))
    return all(m.matches(c, relayout) for s in fwd.body.body[found[0] + 1 :] for c in findall(s, m.Call()))


def _out_proj(init: cst.FunctionDef, fwd: cst.FunctionDef | None, linears: Collection[str]) -> str | None:
    """The output projection among linears: the one named so (OUT), else the only one forward calls after the
    runtime Attention (ModernBERT's `Wo`)."""
    named = next((a for a in OUT if a in linears), None)
    if named or (found := _attention_call(init, fwd)) is None:
        return named
    called = m.Call(m.Attribute(m.Name("self"), m.Name()))
    after = {c.func.attr.value for s in fwd.body.body[found[0] + 1 :] for c in findall(s, called)}
    candidates = after & set(linears)
    return candidates.pop() if len(candidates) == 1 else None


def _qkv_names(
    init: cst.FunctionDef, fwd: cst.FunctionDef | None, linears: Collection[str]
) -> tuple[str, ...]:
    """The q, k and v projections: q_proj / k_proj / v_proj, else the linears whose outputs reach the runtime
    Attention's query, key and value arguments through forward's top-level assignments (Llama's original `wq` /
    `wk` / `wv`)."""
    if all(a in linears for a in QKV) or (found := _attention_call(init, fwd)) is None:
        return QKV
    at, call = found
    args = [a.value for a in call.args[:3] if a.keyword is None]
    fed = tuple(_feeding(fwd.body.body, at, a, linears) for a in args)
    return fed if len(fed) == 3 and None not in fed and len(set(fed)) == 3 else QKV


def _feeding(
    body: Sequence[cst.BaseStatement], before: int, expr: cst.BaseExpression, linears: Collection[str]
) -> str | None:
    """The one linear of linears whose output expr carries, followed back through the top-level assignments of
    body before statement `before` (a tuple target through the matching argument: `q, k = rope(q, k, ...)`)."""
    self_call = m.Call(m.Attribute(m.Name("self"), m.Name()))
    for _ in range(len(body)):
        called = {c.func.attr.value for c in findall(expr, self_call)} & set(linears)
        if called:
            return called.pop() if len(called) == 1 else None
        bound = [(i, s) for i, s in enumerate(body[:before]) if isinstance(s, cst.SimpleStatementLine)]
        names = {n.value for n in findall(expr, m.Name())}
        for i, s in reversed(bound):
            assign = s.body[0] if len(s.body) == 1 and isinstance(s.body[0], cst.Assign) else None
            target = assign.targets[0].target if assign and len(assign.targets) == 1 else None
            if isinstance(target, cst.Name) and target.value in names:
                expr, before = assign.value, i
                break
            if isinstance(target, cst.Tuple) and isinstance(assign.value, cst.Call):
                at = [
                    k
                    for k, e in enumerate(target.elements)
                    if m.matches(e.value, m.Name()) and e.value.value in names
                ]
                if at:
                    given = [a.value for a in assign.value.args if a.keyword is None]
                    if len(at) > 1 or at[0] >= len(given):
                        return None
                    expr, before = given[at[0]], i
                    break
        else:
            return None
    return None


def _set_kwarg(call: cst.Call, pos: int, name: str, value: str) -> cst.Call:
    """call with parameter `name` (positional `pos`) set to value, added as a keyword when absent."""
    if (old := arg(call, pos, name)) is None:
        return appended(call, name, value)
    new = cst.parse_expression(value)
    return call.with_changes(args=[a.with_changes(value=new) if a is old else a for a in call.args])


def _self_attrs(node: cst.CSTNode) -> set[str]:
    return {a.attr.value for a in findall(node, m.Attribute(m.Name("self")))}


def _computed_later(
    init: cst.FunctionDef, exprs: list[str], start: cst.BaseStatement, stop: cst.BaseStatement
) -> bool:
    """Whether exprs read a local or `self.x` that init assigns from `start` up to `stop`."""
    body = init.body.body
    between = body[body.index(start) : body.index(stop)]
    targets = [
        t.target for s in between for t in findall(s, m.AssignTarget() | m.AnnAssign() | m.AugAssign())
    ]
    later_attrs = {t.attr.value for t in targets if m.matches(t, m.Attribute(m.Name("self")))}
    later_locals = set().union(*(assigned_names(s) for s in between)) - {"self"}
    parsed = [cst.parse_expression(e) for e in exprs]
    return any(_self_attrs(e) & later_attrs or free_names(e) & later_locals for e in parsed)


def _hoisted(init: cst.FunctionDef, exprs: list[str], first: cst.BaseStatement) -> cst.FunctionDef | None:
    """init with the lines setting the `self.x` exprs read after `first` (nanoGPT's `self.n_head = config.n_head`,
    set after `self.c_attn`) moved just before it, where each is set once from init's parameters alone; None
    when a value exprs read is computed otherwise."""
    body = list(init.body.body)
    wanted = set().union(*(_self_attrs(cst.parse_expression(e)) for e in exprs))
    setter = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Attribute(m.Name("self"), m.Name()))])])
    moved = []
    for s in body[body.index(first) + 1 :]:
        attr = s.body[0].targets[0].target.attr.value if m.matches(s, setter) else None
        if attr not in wanted:
            continue
        value, sets = (
            s.body[0].value,
            [t for t in findall(init, m.AssignTarget()) if attr in _self_attrs(t)],
        )
        if not (pure(value) and free_names(value) <= set(param_names(init)) - {"self"} and len(sets) == 1):
            return None
        moved.append(s)
    if not moved:
        return None
    kept = [s for s in body if s not in moved]
    at = kept.index(first)
    return init.with_changes(body=init.body.with_changes(body=[*kept[:at], *moved, *kept[at:]]))


def _optional_linears(init: cst.FunctionDef) -> dict[str, Layer]:
    """attr -> Layer for each `self.<attr> = nn.Linear(...)` line of init, in order, also in a block (Gemma 3n
    builds k_proj / v_proj only in layers that do not reuse another layer's keys) and when the value is
    `nn.Linear(...) if <cond> else None` (or the reverse): the layer the model builds when it has one. An attribute
    assigned more than once is left out."""
    optional = m.IfExp(body=m.Call() | m.Name("None"), orelse=m.Call() | m.Name("None"))
    line = m.SimpleStatementLine(
        [m.Assign([m.AssignTarget(m.Attribute(m.Name("self"), m.Name()))], m.Call() | optional)]
    )
    found, seen = {}, []
    for s in findall(init.body, line):
        attr = s.body[0].targets[0].target.attr.value
        seen.append(attr)
        value = s.body[0].value
        branches = [value] if isinstance(value, cst.Call) else [value.body, value.orelse]
        calls = [c for c in branches if isinstance(c, cst.Call) and called_name(c) in LINEAR]
        if len(calls) == 1:
            found[attr] = Layer(attr, s, calls[0])
    return {a: layer for a, layer in found.items() if seen.count(a) == 1}


def _reads_global_size(
    fns: list[cst.FunctionDef], local: list[str], blocks: Sequence[cst.CSTNode] = ()
) -> str | None:
    """A whole-model head count or width that one of fns reads (names only, not docstrings), other than the head
    counts `self.x` of local, which hold this rank's share, a function's own parameters (what its callers pass,
    checked where they call), its locals (what they are computed from is checked here: GPT-2's `bsz,
    num_heads, q_len, d = query.size()` reads the rank's own tensor) and what the nodes of blocks read (the width
    of the blocks a fused projection is laid out in on disk)."""
    fixed = {id(n) for b in blocks for n in findall(b, m.Name())}
    for fn in fns:
        fields = {id(a.attr): a for a in findall(fn, m.Attribute())}
        given = set(param_names(fn)) | assigned_names(fn.body)
        for node in findall(fn, m.Name()):
            if id(node) in fixed:
                continue
            field = fields.get(id(node))
            mine = field is not None and m.matches(field.value, m.Name("self")) and node.value in local
            if (
                GLOBAL_SIZES.fullmatch(node.value)
                and not mine
                and (field is not None or node.value not in given)
            ):
                return node.value
    return None


def _methods(cls: cst.ClassDef) -> list[cst.FunctionDef]:
    """The methods of cls other than __init__."""
    return [f for f in cls.body.body if isinstance(f, cst.FunctionDef) and f.name.value != "__init__"]


SHAPE_READ = "shape", "size"
MINUS_ONE = m.UnaryOperation(m.Minus(), m.Integer("1"))


def _first_view(
    cls: cst.ClassDef, scope: cst.FunctionDef, name: str, after: int
) -> tuple[cst.FunctionDef, cst.Call] | None:
    """(its method, the `.view(...)` / `.reshape(...)` call) that first shapes the tensor `name` holds from
    statement `after` of scope on, when nothing but its `.shape` / `.size()` reads it before (following it into one
    method of cls it is passed to) and its unshaped value is not read after. Guards (`if <test>: raise ...`) do
    not count, and the `else:` after one is read as following it."""
    body = _unguarded(scope.body.body[after + 1 :])
    for i, s in enumerate(body):
        reads = len(findall(s, m.Name(name))) - len(findall(s, m.AssignTarget(m.Name(name))))
        shape_reads = findall(s, m.Attribute(m.Name(name), m.OneOf(*map(m.Name, SHAPE_READ))))
        if reads == len(shape_reads):
            continue
        if reads != len(shape_reads) + 1:
            return None
        rebound = bool(findall(s, m.AssignTarget(m.Name(name))))
        if not rebound and any(findall(later, m.Name(name)) for later in body[i + 1 :]):
            return None
        views = findall(s, m.Call(m.Attribute(m.Name(name), m.Name("view") | m.Name("reshape"))))
        if views:
            return scope, views[0]
        passed = m.Call(
            m.Attribute(m.Name("self"), m.Name()), [m.ZeroOrMore(), m.Arg(m.Name(name)), m.ZeroOrMore()]
        )
        calls = findall(s, passed)
        helper = method(cls, calls[0].func.attr.value) if calls else None
        if helper is None or helper is scope:
            return None
        given = next(a for a in calls[0].args if m.matches(a.value, m.Name(name)))
        param = bound_parameter(calls[0], helper, given)
        return None if param is None else _first_view(cls, helper, param, -1)
    return None


def _shape_dims(scope: cst.FunctionDef, view: cst.Call) -> list[cst.BaseExpression | None] | None:
    """The dims view gives (None for those a starred shape adds), a shape passed by a name bound once in scope
    looked up, a shape `x.size()[:-1] + (a, b)` read as its new dims."""

    def bound(e: cst.BaseExpression) -> cst.BaseExpression:
        if (
            isinstance(e, cst.Name)
            and len(found := findall(scope, m.Assign([m.AssignTarget(m.Name(e.value))]))) == 1
        ):
            return found[0].value
        return e

    def dims(e: cst.BaseExpression) -> list[cst.BaseExpression | None] | None:
        e = bound(e)
        if isinstance(e, cst.Tuple):
            return [None if isinstance(x, cst.StarredElement) else x.value for x in e.elements]
        if m.matches(e, m.BinaryOperation(operator=m.Add(), right=m.Tuple())):
            return [None, *dims(e.right)]
        return None

    if len(view.args) == 1:
        return dims(view.args[0].value)
    return [None if a.star else a.value for a in view.args]


def _first_shape(
    cls: cst.ClassDef, fwd: cst.FunctionDef, attr: str
) -> tuple[cst.FunctionDef, list[cst.BaseExpression | None] | None] | None:
    """(the method that first views the output of `self.<attr>(...)`, called once in forward, the dims it gives):
    a view of the call itself, or _first_view's of the name forward binds it to."""
    project = m.Call(func=m.Attribute(m.Name("self"), m.Name(attr)))
    if self_refs(cls, attr) != 2 or not findall(fwd, project):
        return None
    direct = findall(fwd, m.Call(func=m.Attribute(value=project, attr=m.Name("view") | m.Name("reshape"))))
    bound = bound_call(fwd.body.body, attr)
    found = (fwd, direct[0]) if direct else bound and _first_view(cls, fwd, bound[1], bound[0])
    return (found[0], _shape_dims(*found)) if found else None


def _viewed_per_head(
    cls: cst.ClassDef, fwd: cst.FunctionDef, attr: str, heads: list[str]
) -> tuple[cst.FunctionDef, cst.BaseExpression, list[cst.BaseExpression]] | None:
    """(the method that views it, G, the block dims) when the output of `self.<attr>(...)` is first shaped
    [..., G, *block] with G inferred (-1) or one of the head counts `self.x` of heads (which hold a rank's share),
    and a block of more than one head's width (two dims or a multiple of one): its rows are then whole heads (or
    groups of them), each with its own q, k and v (GPT-NeoX's `query_key_value`, CodeGen's `qkv_proj` in blocks of
    3 x embed_dim / mp_num), and a rank's contiguous share of the rows is its heads'."""
    found = _first_shape(cls, fwd, attr)
    shape = found[1] if found else None
    group = m.OneOf(MINUS_ONE, *(m.Attribute(m.Name("self"), m.Name(h)) for h in heads))
    at = next((i for i, d in enumerate(shape or []) if d is not None and m.matches(d, group)), None)
    if at is None:
        return None
    before, block = shape[:at], shape[at + 1 :]
    multiple = m.BinaryOperation(m.Integer(), m.Multiply()) | m.BinaryOperation(
        operator=m.Multiply(), right=m.Integer()
    )
    wide = len(block) > 1 or (len(block) == 1 and block[0] is not None and m.matches(block[0], multiple))
    if (
        wide
        and not any(
            d is None
            or m.matches(d, MINUS_ONE)
            or (HEAD_COUNTS.search(code(d)) and not m.matches(d, PER_GROUP))
            for d in block
        )
        and not any(d is not None and m.matches(d, m.Integer() | MINUS_ONE) for d in before)
    ):
        return found[0], shape[at], block
    return None


def _unguarded(body: Sequence[cst.BaseStatement]) -> list[cst.BaseStatement]:
    """body's statements without its guards (`if <test>: raise ...`), the `else:` after one read as following it."""
    found = []
    for s in body:
        if isinstance(s, cst.If) and is_guard(s.body):
            rest = s.orelse
            found += _unguarded([rest] if isinstance(rest, cst.If) else rest.body.body) if rest else []
        else:
            found.append(s)
    return found


def _literal_factor(size: cst.BaseExpression) -> int | None:
    """The product of the integer literals a width is multiplied by (`heads * head_dim * 2` -> 2), if not 1."""
    factors, todo = 1, [size]
    while todo:
        e = todo.pop()
        if isinstance(e, cst.BinaryOperation) and isinstance(e.operator, cst.Multiply):
            todo += [e.left, e.right]
        elif isinstance(e, cst.Integer):
            factors *= int(e.value)
    return factors if factors != 1 else None


def _viewed_multi_query(cls: cst.ClassDef, fwd: cst.FunctionDef, attr: str, heads: list[str]) -> bool:
    """The output of `self.<attr>(...)` is first shaped (see _first_shape) `[..., self.<h> + 2, <head size>]`, h one
    of the head counts of heads: its rows are [q heads; one key head; one value head] (Falcon's multi-query
    `query_key_value`), which is how QKVParallelLinear lays out a rank's share (the key and value heads
    replicated), so forward, given this rank's `self.<h>`, needs no change."""
    found = _first_shape(cls, fwd, attr)
    dims = (found[1] or []) if found else []
    if not heads or len(dims) < 2 or dims[-2] is None:
        return False
    row = m.BinaryOperation(
        m.OneOf(*(m.Attribute(m.Name("self"), m.Name(h)) for h in heads)), m.Add(), m.Integer("2")
    )
    return m.matches(dims[-2], row)


def _block_width(
    fwd: cst.FunctionDef, block: list[cst.BaseExpression]
) -> tuple[cst.BaseExpression, list[cst.BaseExpression]] | None:
    """(the block's width with forward's locals written out, the values forward binds them to), or None when it
    reads a parameter or a local bound more than once: the width of the row blocks a fused projection is laid out
    in is fixed by the checkpoint, so what it is computed from stays whole-model."""
    values = local_values(fwd)
    width = cst.parse_expression(code(block[0]) if len(block) == 1 else " * ".join(map(operand, block)))
    used: list[cst.BaseExpression] = []
    for _ in range(len(values) + 1):
        names = {n.value for n in findall(width, m.Name()) if not _is_field(width, n)} - {"self"}
        local = names & set(values)
        if names & (set(param_names(fwd)) | assigned_names(fwd.body)) - local:
            return None
        if not local:
            return width, used
        width = substituted(width, {n: values[n] for n in local})
        used += [values[n] for n in sorted(local)]
    return None


def _is_field(root: cst.CSTNode, name: cst.Name) -> bool:
    """Whether name is the attribute part of an `x.name` within root."""
    return any(a.attr is name for a in findall(root, m.Attribute()))


def _in_region(fwd: cst.FunctionDef, out: str) -> cst.FunctionDef | str:
    """forward inside the class's TPRegion: its partial sums reduced on return, or right after the output projection
    when forward then only adds its other arguments (see exit_point); why not otherwise."""
    exit_at = None
    if not returns_output_of(fwd, out) and (exit_at := exit_point(fwd, out)) is None:
        return f"forward does not return {out}'s output as is, nor only combine it with its other arguments"
    return wrap_region(fwd, exit_at) or "forward takes no hidden-states argument"


def _rewrite_per_head(
    cls: cst.ClassDef,
    ctx: ParallelRewriteContext,
    init: cst.FunctionDef,
    fwd: cst.FunctionDef,
    per_head: list[str] | None = None,
    viewed: tuple[cst.FunctionDef, cst.BaseExpression, list[cst.BaseExpression]] | None = None,
    checks: Sequence[cst.SimpleStatementLine] = (),
) -> cst.ClassDef | str:
    """Attention whose projections are not q/k/v blocks: each projection whose rows are whole heads (multi-head
    latent attention's, whose output size counts the heads; ``per_head``: a fused projection whose output forward
    views per head, ``viewed`` as _viewed_per_head found it) becomes a ColumnParallelLinear (split contiguously),
    the output projection an OProjParallelLinear (row-parallel in attn_tp_group, or in oproj_tp_group over
    attention-DP ranks), the low-rank ones stay replicated, and `Attention` gets this rank's heads."""
    linears = _optional_linears(init)
    attention = list(self_layers(init, {"Attention"}).values())
    out = _out_proj(init, fwd, linears)
    if out is None:
        return "no `self.o_proj = nn.Linear(...)` in __init__"
    if why := _attention_layers_refused(attention, fwd):
        return why
    if not plumbed(init):
        return "__init__ lacks the migrated `comm_manager` / `prefix` parameters"
    counts = _attention_head_counts(init, attention)
    per_head = per_head or [
        a
        for a, layer in linears.items()
        if a != out and (HEAD_COUNTS.search(code(layer.call)) or _reads_any(layer.call, counts))
    ]
    if not per_head:
        return "no q/k/v projections and no projection whose output size counts the heads"
    args = {a: linear_args(linears[a].call) for a in (*per_head, out)}
    if None in args.values():
        return "a projection passes nn.Linear arguments other than in/out features and bias"
    attn = attention[0]
    if arg(attn.call, 0, "num_heads") is None:
        return "the Attention call does not pass num_heads"
    skip = [linears[a].line for a in (*per_head, out)] + [a.line for a in attention]
    if whole := _whole_head_module(init, skip):
        return f"`{whole}` is sized for all heads, but each rank keeps only its share of them"
    local, blocks, guard = _head_attrs(_methods(cls), init, counts), [], list(checks)
    if viewed:
        scope, groups, block = viewed
        width = _block_width(scope, block)
        if m.matches(groups, MINUS_ONE) and width is None:
            return f"the width of the blocks `self.{per_head[0]}`'s output is viewed in depends on the input"
        if m.matches(groups, MINUS_ONE) and GLOBAL_SIZES.search(code(width[0])):
            # blocks of several heads, a fraction of the whole width: checked to be whole when the layer is built
            rows = args[per_head[0]].out_features
            guard += [stmt(f'whole_blocks({rows}, {code(width[0])}, comm_manager, "{GROUP}")\n')]
        blocks = [*block, *(width[1] if width else [])]
    if found := _reads_global_size(_methods(cls), local, blocks):
        return f"a method uses the whole model's `{found}`, which a rank no longer has"
    new_fwd = _in_region(fwd, out)
    if isinstance(new_fwd, str):
        return new_fwd

    def parallel(attr: str, ctor: str, group: str) -> cst.SimpleStatementLine:
        a = args[attr]
        plumbing = f'comm_manager=comm_manager, tp_group="{group}", prefix=join_prefix(prefix, "{attr}")'
        call = cst.parse_expression(f"{ctor}({', '.join(a.layer_args())}, {plumbing})")
        return linears[attr].line.deep_replace(linears[attr].call, call)

    changes = {
        **{id(linears[a].line): parallel(a, "ColumnParallelLinear", GROUP) for a in per_head},
        id(linears[out].line): parallel(out, "OProjParallelLinear", OPROJ_GROUP),
    }
    for layer in attention:
        call = layer.call
        for pos, name in HEAD_ARGS:
            if (given := arg(call, pos, name)) is not None:
                call = _set_kwarg(
                    call, pos, name, f'local_heads({code(given.value)}, comm_manager, "{GROUP}")'
                )
        changes[id(layer.line)] = layer.line.with_changes(
            body=[layer.line.body[0].with_changes(value=_per_head_args(call, cls, layer.attr))]
        )
    new_init = edit_body(
        replace_by_id(init, changes), {}, [*guard, *_localized(local, {}), region(GROUP, whole_sequence=True)]
    )
    name, replicated = cls.name.value, [a for a in linears if a not in (*per_head, out)]
    ctx.rewrites += [
        f"{name}: {'/'.join(per_head)} -> ColumnParallelLinear by heads ({GROUP})",
        f"{name}: {out} -> OProjParallelLinear ({OPROJ_GROUP}, or {GROUP} at o_proj_tp_size attn_tp_size)",
        *(
            [f"{name}: {'/'.join(replicated)} stay replicated (their outputs do not count heads)"]
            * bool(replicated)
        ),
    ]
    return replace_methods(cls, {"__init__": new_init, "forward": new_fwd})


def _aliases(init: cst.FunctionDef) -> dict[str, str]:
    """Locals of init bound once, to another name: `kdim = embed_dim` -> {"kdim": "embed_dim"}."""
    alias = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name())], m.Name())])
    once = [s for s in init.body.body if m.matches(s, alias)]
    bound = [n for s in init.body.body for n in assigned_names(s)]
    return {
        s.body[0].targets[0].target.value: s.body[0].value.value
        for s in once
        if bound.count(s.body[0].targets[0].target.value) == 1
    }


def _rewrite(
    cls: cst.ClassDef, ctx: ParallelRewriteContext, closer: Closer | None = None
) -> list[cst.ClassDef] | str:
    """The sharded class, and the closing half of its unit when it has no output projection of its own (closer:
    BERT's SelfOutput, see _split_unit), or why it can't be sharded."""
    init, fwd = method(cls, "__init__"), method(cls, "forward")
    layers = self_layers(init, {"Attention"}).values()
    if any(kwarg(a.call, "kv_heads_tiled") for a in layers):
        return "keys are tiled over the query heads (kv_heads_tiled): a rank's share of the heads needs every kv head"
    linears = self_layers(init, LINEAR)
    names = _qkv_names(init, fwd, linears)
    if fwd is not None and not any(a in linears for a in (*names, *FUSED_ON_DISK)):
        return _listed(_rewrite_per_head(cls, ctx, init, fwd))
    built = _optional_linears(init)
    if fwd is not None and "q_proj" in linears and any(a not in linears and a in built for a in QKV):
        # k / v built only in some layers, or not always: each projection split by its own heads, unfused
        return _listed(_rewrite_per_head(cls, ctx, init, fwd, [a for a in QKV if a in built]))
    attention = list(self_layers(init, {"Attention"}).values())
    out = _out_proj(init, fwd, linears)
    closer = closer if out is None and _relaid_only_after_attention(init, fwd) else None
    fused = next((a for a in FUSED_ON_DISK if a in linears), None)  # [q; k; v] blocks of one tensor on disk
    head_attrs = _head_attrs(_methods(cls), init)
    viewed = fused and fwd is not None and _viewed_per_head(cls, fwd, fused, head_attrs)
    if viewed:
        counts = [(arg(a.call, 0, "num_heads"), arg(a.call, 3, "num_kv_heads")) for a in attention]
        grouped = any(d is not None and m.matches(d, PER_GROUP) for d in viewed[2])  # whole groups per rank
        differ = {
            (q, kv) for q, kv in counts if kv is not None and (q is None or code(kv.value) != code(q.value))
        }
        checks = []  # counts written differently that this checkpoint makes equal (Falcon's per-head layout)
        for q, kv in differ if not grouped else ():
            same = [checkpoint_value(cls, a.value, ctx.checkpoint_config) for a in (q, kv) if a is not None]
            if len(same) != 2 or not all(ok for ok, _ in same) or same[0][1] != same[1][1]:
                return (
                    f"`self.{fused}` interleaves q, k and v per head, with fewer key heads than query heads"
                )
            checks.append(stmt(f"interleaved_heads({code(q.value)}, {code(kv.value)})\n"))
        return _listed(_rewrite_per_head(cls, ctx, init, fwd, [fused], viewed, checks))
    projections = (fused,) if fused else names
    missing = [a for a in projections if a not in linears] + ([] if out or closer else ["o_proj"])
    if missing == ["o_proj"]:
        return (
            "no `self.o_proj = nn.Linear(...)` in __init__, nor one in the module its output is handed to whole "
            "(see _split_unit)"
        )
    if missing:
        return f"no `self.{missing[0]} = nn.Linear(...)` in __init__"
    if fwd is None:
        return "no forward"
    groups = _head_groups(fwd) if len(_layers_run(attention, fwd)) > 1 else 1
    if why := _attention_layers_refused(attention, fwd, groups):
        return why
    if not plumbed(init):
        return "__init__ lacks the migrated `comm_manager` / `prefix` parameters"
    own = projections + ((out,) if out else ())  # the unit's linears this class holds
    args = [linear_args(linears[a].call) for a in own]
    if None in args:
        return "a projection passes nn.Linear arguments other than in/out features and bias"
    q = args[0]
    if not fused and (factor := _literal_factor(cst.parse_expression(q.out_features))):
        return (
            f"{projections[0]} is {factor}x the query heads wide (`{q.out_features}`: a gate beside each head's "
            "query, as Qwen3-Next's), and QKVParallelLinear's query block is one head_dim a head"
        )
    # `kdim = embed_dim`: BART-style attention's key / value widths, folded for self-attention
    same = _aliases(init)
    inputs = {
        (same.get(a.in_features, a.in_features), a.bias, a.transposed) for a in args[: len(projections)]
    }
    if len(inputs) != 1 and not fused and not any(t for _, _, t in inputs):
        # biased queries beside unbiased keys (or inputs of their own): each projection split by its own heads
        return _listed(_rewrite_per_head(cls, ctx, init, fwd, list(projections)))
    if len(inputs) != 1:
        return (
            "q/k/v projections differ in input size or bias, or in how the checkpoint lays their weights out"
        )
    multi_query = bool(fused) and _viewed_multi_query(cls, fwd, fused, head_attrs)
    if fused and not multi_query:
        fwd = split_fused_output(fwd, fused, 3)
        if isinstance(fwd, str):
            return f"`self.{fused}` is q/k/v fused on disk, and {fwd}"
    qkv_attr, first = fused or "qkv_proj", linears[projections[0]].line
    attn: Layer = attention[0]
    heads, head_dim, kv_heads = (
        arg(attn.call, 0, "num_heads"),
        arg(attn.call, 1, "head_dim"),
        arg(attn.call, 3, "num_kv_heads"),
    )
    if heads is None or head_dim is None:
        return "the Attention call does not pass num_heads and head_dim"
    sizes = [code(a.value) for a in (head_dim, heads, kv_heads or heads)]
    if multi_query:
        sizes[2] = "1"  # the one key head its rows hold, whatever the Attention call computes it from
    if any(init.body.body.index(a.line) < init.body.body.index(first) for a in attention):
        return f"the Attention layer is built before {projections[0]}, whose per-rank head counts it takes"
    if any(_computed_later(init, sizes, first, a.line) for a in attention):
        if (hoisted := _hoisted(init, sizes, first)) is not None:
            return _rewrite(cls.deep_replace(init, hoisted), ctx, closer)
        return f"the Attention head counts use values computed after {projections[0]}"
    sinks = _per_head_params(cls, init, fwd, sizes[1])
    all_heads = {} if fused else _all_head_modules(init, fwd, cls, projections[:2], out)
    gates = _head_gates(cls, init, linears, own, sizes[1])
    skip = [linears[a].line for a in (*own, *gates)] + [a.line for a in attention]
    skip += [s for s in init.body.body if id(s) in sinks or id(s) in all_heads]
    if whole := _whole_head_module(init, skip):
        return f"`{whole}` is sized for all heads, but each rank keeps only its share of them"
    methods = [fwd if f.name.value == "forward" else f for f in _methods(cls)]  # forward as cut above
    widths = _output_widths(methods, init, fwd, out, sizes[1])
    local = _head_attrs(methods, init, sizes[1:]) + widths
    if found := _reads_global_size(methods, local):
        return f"a method uses the whole model's `{found}`, which a rank no longer has"
    new_fwd = fwd if fused else fuse_calls(fwd, names, "qkv_proj")
    if isinstance(new_fwd, str):
        return new_fwd
    new_fwd = _rank_width(init, new_fwd)
    if isinstance(new_fwd, str):
        return new_fwd
    if any(self_refs(cls, a) != 2 for a in projections):
        return f"{'/'.join(projections)} are used outside __init__ and forward"
    new_fwd = (
        _in_region(new_fwd, out)
        if out
        else enter_region(new_fwd) or "forward takes no hidden-states argument"
    )
    if isinstance(new_fwd, str):
        return new_fwd

    qkv = parallel_layer(
        qkv_attr,
        "QKVParallelLinear",
        [
            q.in_features,
            *sizes,
            f"bias={q.bias}",
            *["transposed_on_disk=True"] * q.transposed,
            *[f"head_groups={groups}"] * (groups > 1),
        ],
        GROUP,
        first,
    )
    o_proj = {}  # without an output projection, the closing half of the unit has it
    if out:
        row = [*args[-1].layer_args(), "reduce_results=False"]
        o_proj[id(linears[out].line)] = [
            parallel_layer(out, "RowParallelLinear", row, GROUP, linears[out].line)
        ]
    attn_lines = {}  # every runtime Attention gets this rank's heads (Falcon's rotary and ALiBi ones, one cache)
    for a in attention:
        call = _set_kwarg(a.call, 0, "num_heads", f"self.{qkv_attr}.num_heads")
        call = _set_kwarg(call, 3, "num_kv_heads", f"self.{qkv_attr}.num_kv_heads")
        call = _per_head_args(call, cls, a.attr)
        attn_lines[id(a.line)] = [a.line.with_changes(body=[a.line.body[0].with_changes(value=call)])]
    sink_lines = {id(s): [_wrapped(s, "shard_heads")] for s in init.body.body if id(s) in sinks}
    gate_lines = {
        id(linears[g].line): [
            parallel_layer(
                g,
                "ColumnParallelLinear",
                a.layer_args(),
                GROUP,
                linears[g].line,
            )
        ]
        for g, a in gates.items()
    }
    heads_of = {"q": sizes[1], "k": sizes[2], "o": sizes[1]}
    all_head_lines = {
        id(s): [_wrapped(s, "gather_heads", heads_of[all_heads[id(s)][1]])]
        for s in init.body.body
        if id(s) in all_heads
    }
    new_init = edit_body(
        init,
        {
            **{id(linears[a].line): [] for a in projections},
            id(first): [qkv],
            **o_proj,
            **attn_lines,
            **sink_lines,
            **gate_lines,
            **all_head_lines,
        },
        [
            *_localized(local, _qkv_shares(init, local, qkv_attr, sizes), widths),
            region(GROUP, whole_sequence=True),
        ],
    )
    new_init = drop_unused_locals(new_init, {n for a in projections for n in free_names(linears[a].call)})
    name = cls.name.value
    applied = {"q": f"{names[0]}'s output", "k": f"{names[1]}'s output", "o": f"{out}'s input"}
    ctx.rewrites += [
        f"{name}: {'/'.join(projections)} -> QKVParallelLinear {qkv_attr} ({GROUP})"
        + (f", a rank's share of each of {groups} runs of heads forward pairs up" if groups > 1 else ""),
        f"{name}: {out} -> RowParallelLinear ({GROUP})"
        if out
        else f"{closer.cls.name.value}: {closer.linear.attr}, the output projection {name}'s output is handed"
        f" to, -> RowParallelLinear ({GROUP}, summed in the TPRegion of {closer.cls.name.value})",
        *(f"{name}: {a} -> this rank's heads (shard_heads, {GROUP})" for a in sinks.values()),
        *(
            f"{name}: {g} -> ColumnParallelLinear by query heads, like {projections[0]} ({GROUP})"
            for g in gates
        ),
        *(
            f"{name}: {a} runs on every head of {applied[k]} (gather_heads, {GROUP})"
            for a, k in all_heads.values()
        ),
    ]
    ctx.head_groups = max(ctx.head_groups, groups)
    if not fused:
        stacked = [(".qkv_proj", f".{a}", shard) for a, shard in zip(names, "qkv", strict=True)]
        ctx.fused += [s for s in stacked if s not in ctx.fused]
    new = replace_methods(cls, {"__init__": new_init, "forward": new_fwd})
    return [new, *([closed(closer, GROUP, whole_sequence=True)] if closer else [])]


def _listed(result: cst.ClassDef | str) -> list[cst.ClassDef] | str:
    """A rewrite's one class as the list _rewrite returns, or why not."""
    return result if isinstance(result, str) else [result]


def _per_head_args(call: cst.Call, cls: cst.ClassDef, attr: str) -> cst.Call:
    """The runtime Attention `self.<attr> = call` of cls given what it needs of this rank's heads besides their
    counts: its ALiBi slopes (`alibi_slopes=`, one per head) cut to them, and where a method hands it an indexer's
    picks (`selected=`, which may come per group of heads) which share of the heads they are."""
    if (slopes := kwarg(call, "alibi_slopes")) is not None:
        share = f'local_share({code(slopes.value)}, comm_manager, "{GROUP}")'
        call = _set_kwarg(call, len(call.args), "alibi_slopes", share)
    if any(kwarg(c, "selected") for c in findall(cls, _calls_layer(attr))):
        call = _set_kwarg(call, len(call.args), "head_share", f'head_share(comm_manager, "{GROUP}")')
    return call


def _qkv_shares(init: cst.FunctionDef, attrs: list[str], qkv: str, sizes: list[str]) -> dict[str, str]:
    """head count x -> `self.<qkv>.num_heads` / `.num_kv_heads` when __init__ sets x to what QKVParallelLinear was
    given as the query / key heads (a rank holds one replica of a key head when they are fewer than its ranks)."""
    # the query heads last: when __init__ gives both counts as one value, x is the query heads' share
    given = {sizes[2]: f"self.{qkv}.num_kv_heads", sizes[1]: f"self.{qkv}.num_heads"}
    shares = {}
    for a in attrs:
        (line,) = [
            s for s in init.body.body if findall(s, m.AssignTarget(m.Attribute(m.Name("self"), m.Name(a))))
        ]
        value = code(line.body[0].value)
        if value in given or f"self.{a}" in given:
            shares[a] = given.get(value) or given[f"self.{a}"]
    return shares


def _wrapped(line: cst.SimpleStatementLine, helper: str, *args: str) -> cst.SimpleStatementLine:
    """`self.x = <value>` -> `self.x = helper(<value>, *args, comm_manager, GROUP)`."""
    assign = line.body[0]
    value = cst.parse_expression(
        f'{helper}({", ".join([code(assign.value), *args])}, comm_manager, "{GROUP}")'
    )
    return line.with_changes(body=[assign.with_changes(value=value)])


def _replicated(cls: cst.ClassDef) -> cst.ClassDef | None:
    """cls run whole on every rank: a ReplicatedRegion gathers its DP rank's tokens on the way in and keeps this
    rank's rows on the way out; None when forward takes no hidden-states argument."""
    init, fwd = method(cls, "__init__"), method(cls, "forward")
    wrapped = None if fwd is None else wrap_region(fwd)
    if wrapped is None:
        return None
    init = edit_body(init, {}, [stmt(f'self.tp_region = ReplicatedRegion(tp_group="{GROUP}")\n')])
    return replace_methods(cls, {"__init__": init, "forward": wrapped})


def _is_attention(init: cst.FunctionDef) -> bool:
    """Builds a runtime Attention, or projects queries and keys: not a sparse-attention indexer (its key cache an
    `IndexKeyCache`), which runs whole on every rank, its projections plain linears, like the rest of the model's
    replicated modules."""
    if self_layers(init, {"IndexKeyCache"}):
        return False
    return bool(self_layers(init, {"Attention"})) or any(
        a in (*QKV, *FUSED_ON_DISK) for a in self_layers(init, LINEAR)
    )


class ShardAttention(Rule):
    ID = "PR001"
    DESCRIPTION = (
        "Attention is sharded by heads: QKVParallelLinear in, RowParallelLinear out (attn_tp_group)."
    )

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        ctx = self.rewrite
        new = {}
        for name, cls in classes(module).items():
            init = method(cls, "__init__")
            if init is None or has_region(cls):
                continue
            if _is_attention(init):
                result = _rewrite(cls, ctx, closing_half(module, name))
                if isinstance(result, str) and ctx.replicate_attention and (whole := _replicated(cls)):
                    new[name] = whole
                    ctx.replicated.append(name)
                    ctx.rewrites.append(
                        f"{name}: runs whole on every rank of {GROUP}, its weights and KV cache unsplit "
                        f"(ReplicatedRegion; it cannot be sharded by heads: {result})"
                    )
                elif isinstance(result, str):
                    ctx.unsupported(
                        name,
                        0,
                        f"attention cannot be sharded by heads: {result} (`skill parallelize "
                        "--replicate-attention` runs it whole on every rank instead)",
                    )
                else:
                    new |= {c.name.value: c for c in result}
        if not new:
            return module
        text = "".join(code(cls) for cls in new.values())
        used = [
            *REGION_IMPORTS,
            *((LINEAR_IMPORT, c) for c in ("QKVParallelLinear", "ColumnParallelLinear", "RowParallelLinear")),
        ]
        used += [
            ("runtime.layers.head_shard", h)
            for h in (
                "local_heads",
                "local_kv_heads",
                "head_share",
                "local_width",
                "local_share",
                "shard_heads",
                "gather_heads",
                "whole_blocks",
                "interleaved_heads",
            )
        ]
        used += [
            ("runtime.layers.oproj", "OProjParallelLinear"),
            ("runtime.layers.token_layout", "ReplicatedRegion"),
        ]
        self.add_needed_imports([(src, name) for src, name in used if re.search(rf"\b{name}\(", text)])
        return replace_classes(module, new)
