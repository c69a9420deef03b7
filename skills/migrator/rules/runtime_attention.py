"""The attention call (`ALL_ATTENTION_FUNCTIONS` / `eager_attention_forward`) becomes the runtime's
`Attention` layer, which owns the KV cache: `self.attn = Attention(...)` is built in `__init__` from the
arguments HF passed at call time (scaling, sliding window, soft cap), the forward calls
`self.attn(q, k, v, forward_metadata)`, and the unused attention-weights output disappears, callers
included."""

import re
from typing import Any, NamedTuple

import libcst as cst
import libcst.matchers as m

from skills.migrator.call_sites import loop_over
from skills.migrator.context import RewriteContext
from skills.migrator.cst_utils import (
    KwargsPassing,
    Transformer,
    assigned_names,
    called_name,
    class_choice,
    class_table_members,
    classes,
    code,
    findall,
    free_names,
    kwarg,
    method,
    param_names,
    pure,
    stmt,
    substituted,
    with_forward_metadata,
)
from skills.migrator.reachability import reachable, top_level_names
from skills.migrator.rule import Rule

HEADS_FIRST = "heads_first_attention"  # MG021's form of attention written out by hand
HEAD_DIM = "attention_head_dim"  # MG021's name for the per-head size its scale read from q or v at run time
INTERFACE = {"attention_interface", "eager_attention_forward", HEADS_FIRST}
IGNORED_KWARGS = {"dropout", "is_causal", "position_ids", "layer_idx", "cache_position"}
RUNTIME_KWARGS = {
    "scaling": "scale",
    "sliding_window": "sliding_window",
    "softcap": "soft_cap",
    "alibi": "alibi_slopes",  # MG021's: an ALiBi bias on the scores, times this factor
    "keep_keys": "keep_keys",  # MG033's: only the keys of the largest bias past this many
    "index_block": "select_block",  # MG032's: the picks passed as `indices=` number blocks of this many keys
}
# passed on every call: GPT-OSS's per-head sink logits, MG023's cache key of a looped layer, the positions a
# sparse-attention indexer picked (MG032), a score bias per key (MG033)
FORWARD_KWARGS = {
    "s_aux": "sinks",
    "cache_key": "cache_key",
    "indices": "selected",
    "key_bias": "key_bias",
    "distance_bias": "distance_bias",  # MG038's: a relative position bias by backward distance
    "sinks": "sinks",  # Inkling2's, one per query token and head
}
PICKS_RULE = "MG032"  # the rule whose key cache gives `indices=` its meaning in the runtime
KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "kv_heads", "n_kv_heads")  # the module's own count
INIT_NAMES = {"self", "config", "getattr", "hasattr", "None", "True", "False", "int", "float", "math"}


def interface_call(s: cst.BaseStatement) -> cst.Call | None:
    calls = findall(s, m.Call(func=m.Name()))
    return next((c for c in calls if called_name(c) in INTERFACE), None)


class NamedArgument(NamedTuple):
    """A forward's attention call passing a name as one keyword: `attention_interface(..., <keyword>=<name>)`."""

    forward: cst.FunctionDef
    line: cst.BaseStatement  # the top-level statement of forward holding the call
    call: cst.Call
    arg: cst.Arg  # its value a cst.Name


def named_argument(cls: cst.ClassDef, keyword: str) -> NamedArgument | None:
    """cls's forward passing its attention call a name as `keyword=`, if it does."""
    fwd = method(cls, "forward")
    line = next((s for s in fwd.body.body if interface_call(s)), None) if fwd else None
    call = interface_call(line) if line else None
    arg = kwarg(call, keyword) if call else None
    return (
        NamedArgument(fwd, line, call, arg) if arg is not None and isinstance(arg.value, cst.Name) else None
    )


def attention_classes(module: cst.Module, entry: str) -> set[str]:
    """Attention classes the entry class uses (a multimodal file's vision attention is left alone)."""
    used = {n for i in reachable(module, {entry}) for n in top_level_names(module.body[i])}
    return {
        name
        for name, cls in classes(module).items()
        if name in used
        and (fwd := method(cls, "forward")) is not None
        and any(interface_call(s) for s in fwd.body.body)
    }


class _Forward(Transformer):
    """Inside an attention class's forward."""

    def __init__(self, ctx: RewriteContext, scope: str):
        self.ctx, self.scope = ctx, scope
        self.calls: list[
            cst.Call
        ] = []  # one runtime Attention (and KV cache) each: `self.attn`, `self.attn_2`
        self.weights: set[str] = set()  # what each call's weights were bound to (Falcon's paths differ)

    def leave_SimpleStatementLine(self, original, updated):
        if assigned_names(updated) == {"attention_interface"}:
            return cst.RemoveFromParent()
        call = interface_call(updated)
        if call is None or not isinstance(updated.body[0], cst.Assign):
            return updated
        self.calls.append(call)
        target = updated.body[0].targets[0].target
        out = target.elements[0].value if isinstance(target, cst.Tuple) else target
        if isinstance(target, cst.Tuple) and len(target.elements) > 1:
            self.weights.add(cst.Module([]).code_for_node(target.elements[1].value))
        q, k, v = (a.value for a in call.args[1:4])
        layer = f"self.{attention_attr(len(self.calls))}"
        if called_name(call) == HEADS_FIRST:
            layer += ".forward_heads_first"
        new = cst.Assign([cst.AssignTarget(out)], cst.parse_expression(f"{layer}(q, k, v, forward_metadata)"))
        forwarded = [
            a.with_changes(keyword=cst.Name(FORWARD_KWARGS[a.keyword.value]), comma=cst.MaybeSentinel.DEFAULT)
            for a in call.args
            if a.keyword and a.keyword.value in FORWARD_KWARGS
        ]
        args = [
            cst.Arg(q),
            cst.Arg(k),
            cst.Arg(v),
            new.value.args[3].with_changes(comma=cst.MaybeSentinel.DEFAULT),
        ]
        new = new.with_changes(value=new.value.with_changes(args=[*args, *forwarded]))
        return updated.with_changes(body=[new])

    def leave_If(self, original, updated):
        if all(
            assigned_names(s) == {"attention_interface"} or m.matches(s, m.SimpleStatementLine([m.Pass()]))
            for s in updated.body.body
        ):
            return cst.RemoveFromParent()
        return updated

    def leave_Return(self, original, updated):
        return _without(updated, self.weights)


def _without(ret: cst.Return, dropped: set[str]) -> cst.Return:
    """`return out, weights` -> `return out` for the weights expressions (as code) in dropped."""
    if not isinstance(ret.value, cst.Tuple):
        return ret
    kept = [e for e in ret.value.elements if cst.Module([]).code_for_node(e.value) not in dropped]
    if len(kept) == len(ret.value.elements):
        return ret
    kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return ret.with_changes(value=kept[0].value if len(kept) == 1 else ret.value.with_changes(elements=kept))


def attention_attr(n: int) -> str:
    """The n-th (1-based) runtime Attention of a class: `attn`, then `attn_2`, ..."""
    return "attn" if n == 1 else f"attn_{n}"


def _forward_kv_heads(fwd: cst.FunctionDef) -> str | None:
    """The key-head count a forward computes for itself from its module's attributes (`num_kv_heads =
    self.num_heads if self.new_decoder_architecture else self.num_kv_heads`): what its cache holds."""
    line = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name())])])
    for s in fwd.body.body:
        if m.matches(s, line) and s.body[0].targets[0].target.value in KV_HEAD_ATTRS:
            value = s.body[0].value
            if pure(value) and free_names(value) <= {"self", "config"}:
                return cst.Module([]).code_for_node(value)
    return None


def _input_widths(init: cst.FunctionDef, fwd: cst.FunctionDef) -> dict[str, cst.BaseExpression]:
    """Names forward binds to a tensor's last size (nanoGPT's `B, T, C = x.size()`) -> that width as __init__
    knows it: the input size of a Linear layer forward applies to the same tensor (`self.c_attn(x)`)."""
    linears = {}
    for a in findall(init, m.Assign([m.AssignTarget(m.Attribute(m.Name("self")))], m.Call())):
        if called_name(a.value).split(".")[-1] == "Linear" and a.value.args and not a.value.args[0].keyword:
            linears[a.targets[0].target.attr.value] = a.value.args[0].value
    sizes = m.Call(m.Attribute(m.Name(), m.Name("size")), []) | m.Attribute(m.Name(), m.Name("shape"))
    found = {}
    for a in findall(fwd, m.Assign([m.AssignTarget(m.Tuple([m.ZeroOrMore(), m.Element(m.Name())]))], sizes)):
        x = (a.value.func.value if isinstance(a.value, cst.Call) else a.value).value
        applied = [
            linears[c.func.attr.value]
            for c in findall(fwd, m.Call(m.Attribute(m.Name("self")), [m.Arg(m.Name(x), keyword=None)]))
            if c.func.attr.value in linears
        ]
        widths = {code(w) for w in applied}
        if len(widths) == 1 and free_names(applied[0]) <= {"self", "config"}:
            found[a.targets[0].target.elements[-1].value.value] = applied[0]
    return found


def _viewed(fwd: cst.FunctionDef, x: cst.BaseExpression, init: cst.FunctionDef) -> tuple[str, str] | None:
    """(heads, head size) forward views the tensor it names x with (`x.view(x.size()[:-1] + (self.groups,
    self.size))`, `x.view(b, t, self.heads, self.size)`), where both read only module attributes or the config,
    or a width forward read off a tensor that __init__ knows (`C // self.n_head`, see _input_widths)."""
    moved = m.Call(func=m.Attribute(attr=m.Name("transpose") | m.Name("permute") | m.Name("contiguous")))
    while m.matches(x, moved):
        x = x.func.value  # moving the heads does not change their count
    viewed = m.Call(func=m.Attribute(attr=m.Name("view") | m.Name("reshape")))
    widths = _input_widths(init, fwd)
    for a in findall(fwd, m.Assign([m.AssignTarget(m.Name(x.value))])) if isinstance(x, cst.Name) else []:
        value = a.value
        while m.matches(value, moved):
            value = value.func.value  # `q.view(b, t, heads, size).transpose(1, 2)`
        if not m.matches(value, viewed):
            continue
        dims = [d.value for d in value.args]
        if len(dims) == 1 and m.matches(dims[0], m.BinaryOperation(right=m.Tuple()) | m.Tuple()):
            dims = [
                e.value
                for e in (dims[0].right if isinstance(dims[0], cst.BinaryOperation) else dims[0]).elements
            ]
        dims = [substituted(d, widths) for d in dims]
        sized = [d for d in dims[-2:] if pure(d) and free_names(d) and free_names(d) <= {"self", "config"}]
        if len(dims) >= 2 and len(sized) == 2:  # not a literal (`-1`: whatever is left) nor a run-time size
            return code(dims[-2]), code(dims[-1])
    return None


def _queries(fwd: cst.FunctionDef, call: cst.Call, init: cst.FunctionDef) -> tuple[str, str] | None:
    """(heads, head size) forward views the queries it gives the attention call with (see _viewed)."""
    return _viewed(fwd, call.args[1].value, init) if len(call.args) > 1 else None


def _viewed_kv_heads(
    fwd: cst.FunctionDef, q: cst.BaseExpression, k: cst.BaseExpression, init: cst.FunctionDef
) -> str | None:
    """The keys' head count as forward views them, where it views the queries with another."""
    keys = _viewed(fwd, k, init)
    return keys[0] if keys is not None and keys != _viewed(fwd, q, init) else None


def _attention_ctor(
    call: cst.Call, init: cst.FunctionDef, fwd: cst.FunctionDef, ctx: RewriteContext, scope: str, attr: str
) -> cst.BaseStatement:
    init_code = cst.Module([]).code_for_node(init)
    queries = _queries(fwd, call, init)
    head_dim = next(
        (f"self.{a}" for a in ("qk_head_dim", "head_dim", "head_size") if f"self.{a} =" in init_code),
        queries[1]
        if queries
        else "config.hidden_size // config.num_attention_heads",  # as forward views them
    )
    heads = _set_otherwise(init, ("num_heads",), "num_attention_heads") or _query_heads(
        init, queries, ctx.checkpoint_config
    )
    args = [f"num_heads={heads}", f"head_dim={head_dim}"]
    if "self.v_head_dim =" in init_code:  # MLA: values narrower than queries / keys
        args.append("v_head_dim=self.v_head_dim")
    kv_attr = next((a for a in KV_HEAD_ATTRS if f"self.{a} =" in init_code), None)
    kv_local = next((a for a in KV_HEAD_ATTRS if any(a in assigned_names(s) for s in init.body.body)), None)
    if kv_local:  # e.g. MiMo-V2: `num_key_value_heads = config.num_key_value_heads * 2 if is_swa else ...`
        args.append(f"num_kv_heads={kv_local}")
    elif in_forward := _forward_kv_heads(fwd):  # Falcon-40B's keys, broadcast to every query head
        args.append(f"num_kv_heads={in_forward}")
    elif own_kv := _set_otherwise(init, KV_HEAD_ATTRS, "num_key_value_heads"):
        args.append(f"num_kv_heads={own_kv}")
    elif "num_key_value_heads" in init_code:
        args.append("num_kv_heads=config.num_key_value_heads")
    elif kv_attr:  # e.g. `self.kv_heads = 1 if self.multi_query else self.num_heads`
        args.append(f"num_kv_heads=self.{kv_attr}")
    elif len(call.args) > 3 and (
        viewed := _viewed_kv_heads(fwd, call.args[1].value, call.args[2].value, init)
    ):
        args.append(f"num_kv_heads={viewed}")  # ChatGLM's `multi_query_group_num` key heads
    for a in call.args:
        key = a.keyword.value if a.keyword else None
        if key == "indices" and PICKS_RULE not in ctx.applied:
            ctx.unsupported(
                scope,
                0,
                "attention argument `indices=` (positions a sparse-attention indexer picked) without the indexer "
                f"key cache {PICKS_RULE} builds: the runtime would read them as positions it does not hold",
            )
            continue
        if key is None or key in IGNORED_KWARGS or key in FORWARD_KWARGS:
            continue
        if key == "shares_cache":  # MG021's: one of two computations a forward picks between, on one cache
            args.append(f"cache_of=self.{attention_attr(1)}")
            continue
        if key not in RUNTIME_KWARGS:
            ctx.unsupported(
                scope, 0, f"attention argument `{key}=` has no equivalent in the runtime Attention"
            )
            continue
        arg = m.replace(a.value, m.Name(HEAD_DIM), cst.parse_expression(f"({head_dim})"))
        value = cst.Module([]).code_for_node(arg)
        if free_names(arg) - INIT_NAMES - set(param_names(init)):
            ctx.unsupported(scope, 0, f"attention argument `{key}={value}` depends on forward-time values")
        if key == "alibi":
            value = f"alibi_slopes({heads})" if value == "1.0" else f"alibi_slopes({heads}, scale={value})"
        args.append(f"{RUNTIME_KWARGS[key]}={value}")
    if kwarg(call, "key_bias"):  # cached with the keys
        args.append("key_bias=True")
    if kwarg(call, "scaling") is None:
        args.append(
            f"scale={head_dim}**-0.5" if head_dim.startswith("self.") else f"scale=({head_dim}) ** -0.5"
        )
    if ctx.kv_layout == "legacy":
        args.append("legacy=True")
    return stmt(f"self.{attr} = Attention({', '.join(args)})\n")


def _set_otherwise(init: cst.FunctionDef, attrs: tuple[str, ...], field: str) -> str | None:
    """`self.<attr>` for the first of attrs that init sets from anything but `config.<field>` (Inkling's sliding
    layers: `config.swa_num_attention_heads if self.is_sliding else config.num_attention_heads`)."""
    for attr in attrs:
        target = m.AssignTarget(m.Attribute(m.Name("self"), m.Name(attr)))
        values = [a.value for a in findall(init, m.Assign([target]))]
        if values and any(code(v) != f"config.{field}" for v in values):
            return f"self.{attr}"
    return None


def _own_head_count(init: cst.FunctionDef) -> bool:
    """An attention built from sizes rather than a config (XGLM's `XGLMAttention(embed_dim, num_heads)`)."""
    return all(f"self.{a} =" in code(init) for a in ("num_heads", "head_dim"))


def _query_heads(
    init: cst.FunctionDef, queries: tuple[str, str] | None, checkpoint_config: Any
) -> str | None:
    """The query heads' count: the config's `num_attention_heads` where __init__ is given the config under that
    name and it has the field, else the count forward views the queries with when it reads only the module's
    attributes (Meta's `xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)`), else the module's own
    `self.num_heads`; None without any."""
    text = checkpoint_config.get_text_config() if checkpoint_config is not None else None
    named = text is None or hasattr(text, "num_attention_heads")
    if "config" in param_names(init) and named:
        return "config.num_attention_heads"
    if queries and free_names(cst.parse_expression(queries[0])) <= {"self"}:
        return queries[0]
    return "self.num_heads" if _own_head_count(init) else None


class _Classes(Transformer):
    def __init__(self, ctx: RewriteContext, attn: set[str], tables: dict[str, set[str]]):
        self.ctx, self.attn, self.tables = ctx, attn, tables
        self.narrowed: set[str] = set()  # wrappers whose forward passed the weights on and no longer does
        self.reaching: set[str] = set()  # classes whose forward reaches an attention layer
        self.single: set[str] = set()  # classes narrowed from `(output, weights)` to the output alone

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        name = updated.name.value
        if name in self.attn:
            return self._rewrite_attention(updated)
        held = _attention_attrs(updated, self.attn | self.narrowed, self.tables)
        if not held:
            # a class holding one that holds attention (a model's decoder layers): pass kwargs on to them
            if held := _attention_attrs(updated, self.reaching, self.tables):
                self.reaching.add(name)
                return updated.visit(_PassKwargs(set(held), _mixed(held)))
            return updated
        self.reaching.add(name)
        single = set(_attention_attrs(updated, self.single, self.tables))
        callers = _DropWeightsAtCallers(set(held), _mixed(held), single)
        updated = updated.visit(callers)
        if callers.narrowed_forward:  # BERT's BertAttention returns its self-attention's weights
            self.narrowed.add(name)
            self._note_single(updated)
        return updated

    def _note_single(self, cls: cst.ClassDef) -> None:
        """cls (whose forward returned the attention weights beside its output) now returns the output alone."""
        if not findall(method(cls, "forward"), m.Return(value=m.Tuple())):
            self.single.add(cls.name.value)

    def _rewrite_attention(self, cls: cst.ClassDef) -> cst.ClassDef:
        name = cls.name.value
        fwd, init = method(cls, "forward"), method(cls, "__init__")
        rewriter = _Forward(self.ctx, name)
        new_fwd = with_forward_metadata(fwd.visit(rewriter))
        if rewriter.weights:
            new_fwd = new_fwd.with_changes(returns=None)
        if not rewriter.calls:
            self.ctx.unsupported(name, 0, "attention call whose result is not assigned")
            return cls
        config = self.ctx.checkpoint_config
        if init is None or any(
            _query_heads(init, _queries(fwd, c, init), config) is None for c in rewriter.calls
        ):
            self.ctx.unsupported(
                name,
                0,
                "attention class without an `__init__(config, ...)`, its own `self.num_heads` or queries viewed "
                "by a head count it holds",
            )
            return cls
        ctors = [
            _attention_ctor(call, init, fwd, self.ctx, name, attention_attr(n))
            for n, call in enumerate(rewriter.calls, 1)
        ]
        new_init = init.with_changes(body=init.body.with_changes(body=[*init.body.body, *ctors]))
        body = [new_fwd if s is fwd else new_init if s is init else s for s in cls.body.body]
        cls = cls.with_changes(body=cls.body.with_changes(body=body))
        if rewriter.weights:
            self._note_single(cls)
        return cls


def _attention_attrs(cls: cst.ClassDef, attn: set[str], tables: dict[str, set[str]]) -> dict[str, bool]:
    """`self.X` attributes of cls that hold an attention module, or a list of them (`nn.ModuleList([...])`),
    built directly, through a choice between attention classes (`cls = A if c else B`), as one branch of a
    conditional (Bailing-Hybrid's `self.self_attn = A(...) if full else LinearAttention(...)`), from a table of
    classes (Nemotron-H's `self.mixer = MIXER_TYPES[kind](...)`; `tables`: name -> its classes), or appended to a
    list the attribute then holds (Bamba's decoder layers). Each says whether it may hold another module instead
    (a conditional's other branch, a table's other classes), whose calls stay as they are written."""
    attn = attn | {a.targets[0].target.value for a in findall(cls, class_choice(attn))}
    # `layers.append(Layer(...))`, then `self.layers = nn.ModuleList(layers)`; or `self.layers = nn.ModuleList()`,
    # then `self.layers.append(Layer(...))` (Meta's reference Llama)
    appended: dict[str, list[cst.Call]] = {}
    held = m.Name() | m.Attribute(m.Name("self"), m.Name())
    for c in findall(cls, m.Call(func=m.Attribute(held, m.Name("append")), args=[m.Arg(m.Call())])):
        appended.setdefault(code(c.func.value), []).append(c.args[0].value)
    found = {}
    for a in findall(
        cls, m.Assign(targets=[m.AssignTarget(m.Attribute(value=m.Name("self")))], value=m.Call() | m.IfExp())
    ):
        calls = findall(a.value, m.Call()) + appended.get(code(a.targets[0].target), [])
        calls += [c for n in findall(a.value, m.Name()) for c in appended.get(n.value, ())]
        tabled = {
            k
            for c in calls
            if m.matches(c.func, m.Subscript(m.Name()))
            for k in tables.get(c.func.value.value, ())
        }
        built = {called_name(c) for c in calls} | tabled
        if built & attn:
            branches = [a.value.body, a.value.orelse] if isinstance(a.value, cst.IfExp) else []
            other = bool(tabled - attn) or any(
                called_name(b) not in attn for b in branches if isinstance(b, cst.Call)
            )
            found[a.targets[0].target.attr.value] = other
    return found


def _mixed(held: dict[str, bool]) -> set[str]:
    return {attr for attr, other in held.items() if other}


class _PassKwargs(KwargsPassing):
    """Calls of the modules in attrs (`self.X(...)`, `self.X[i](...)`, or `layer(...)` in a loop over `self.X`)
    pass the caller's `**` parameter on, or that of the function it is defined in (`**kwargs`, added to its
    signature if none has one), so that forward_metadata reaches attention."""

    def __init__(self, attrs: set[str], mixed: set[str]):
        super().__init__()
        self.attrs, self.mixed = attrs, mixed  # mixed: may hold another module, whose calls are left alone
        self.loop_vars: dict[str, str] = {}  # name bound by `for` over `self.X` -> X

    def visit_For(self, node: cst.For) -> None:
        if (over := loop_over(node)) is not None and over[0].attr.value in self.attrs:
            self.loop_vars[over[1]] = over[0].attr.value

    def _is_attention_call(self, node, attrs: set[str] | None = None) -> bool:
        """A call of the modules in attrs (default: all this transformer threads kwargs to)."""
        if not isinstance(node, cst.Call):
            return False
        attrs = self.attrs if attrs is None else attrs
        func = node.func.value if isinstance(node.func, cst.Subscript) else node.func
        if isinstance(func, cst.Name):
            return self.loop_vars.get(func.value) in attrs
        return m.matches(func, m.Attribute(value=m.Name("self"))) and func.attr.value in attrs

    def leave_Call(self, original, updated):
        if (
            not self.stars
            or not self._is_attention_call(updated, self.attrs - self.mixed)
            or any(a.star == "**" for a in updated.args)
        ):
            return updated
        return self.with_kwargs(updated)

    def leave_FunctionDef(self, original, updated):
        self.loop_vars = {}
        return super().leave_FunctionDef(original, updated)


class _DropWeightsAtCallers(_PassKwargs):
    """`h, _ = self.self_attn(...)` -> `h = self.self_attn(...)` (`h, _, r = ...` -> `h, r = ...`); the call
    passes `**kwargs` on."""

    def __init__(self, attrs: set[str], mixed: set[str], single: set[str]):
        super().__init__(attrs, mixed)
        # attrs whose modules returned `(output, weights)` and now return the output alone
        self.single = single
        self.whole: set[str] = set()  # names bound to such a call's result in the current function
        self.weights: set[str] = set()  # names the weights were bound to in the current function
        self.returns_narrowed = False  # a return of the current function no longer passes them on
        self.narrowed_forward = False

    def leave_Assign(self, original, updated):
        target = updated.targets[0].target
        if isinstance(target, cst.Tuple) and self._is_attention_call(updated.value):
            if m.matches(target.elements[1].value, m.Name()) and target.elements[1].value.value != "_":
                self.weights.add(target.elements[1].value.value)
            kept = [
                e for i, e in enumerate(target.elements) if i != 1
            ]  # the weights (JetMoE returns 3 values)
            kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            new = kept[0].value if len(kept) == 1 else target.with_changes(elements=kept)
            return updated.with_changes(targets=[cst.AssignTarget(new)])
        if isinstance(target, cst.Name):  # a name bound to such a call's output alone, until rebound
            if self._is_attention_call(updated.value, self.single):
                self.whole.add(target.value)
            else:
                self.whole.discard(target.value)
        return updated

    def leave_Subscript(self, original, updated):
        """`outputs[0]` of a call that returned `(output, weights)` and now returns the output alone."""
        first = m.Subscript(m.Name(), [m.SubscriptElement(m.Index(m.Integer("0")))])
        return updated.value if m.matches(updated, first) and updated.value.value in self.whole else updated

    def leave_Return(self, original, updated):
        narrowed = _without(updated, self.weights)
        # `return self.attention(...)` (GPT-Neo's wrapper) passes on a result now without the weights
        self.returns_narrowed |= narrowed is not updated or self._is_attention_call(
            updated.value, self.single
        )
        return narrowed

    def leave_FunctionDef(self, original, updated):
        self.narrowed_forward |= self.returns_narrowed and updated.name.value == "forward"
        self.weights, self.whole, self.returns_narrowed = set(), set(), False
        return super().leave_FunctionDef(original, updated)


# torch.nn's attention modules: attention a model builds whole instead of writing it out
TORCH_ATTENTION = {
    "MultiheadAttention",
    "Transformer",
    "TransformerEncoder",
    "TransformerDecoder",
    "TransformerEncoderLayer",
    "TransformerDecoderLayer",
}


def _torch_attention(module: cst.Module) -> list[tuple[str, cst.Call]]:
    """(class, construction) of every torch.nn attention module a class of the file builds (not a class of the
    file's own named so: Meta's Llama calls its model `Transformer`)."""
    local = classes(module)
    return [
        (name, c)
        for name, cls in local.items()
        for c in findall(cls, m.Call())
        if (leaf := called_name(c).split(".")[-1]) in TORCH_ATTENTION and leaf not in local
    ]


class RuntimeAttention(Rule):
    ID = "MG005"
    DESCRIPTION = "The attention call becomes the runtime's Attention layer, which owns the KV cache."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        ctx = self.rewrite
        attn = attention_classes(module, ctx.entry_class)
        if not attn:
            if "forward_metadata" in module.code:  # converted already
                return module
            torch_attention = _torch_attention(module)
            for owner, built in torch_attention:
                ctx.unsupported(
                    owner,
                    0,
                    f"`{code(built)}` is torch's own attention module (its packed `in_proj_weight`, masks given "
                    "per call), which the rules do not convert; write it as q / k / v projections and an "
                    "attention call (`F.scaled_dot_product_attention`), or port it by hand",
                )
            if not torch_attention:
                ctx.unsupported(
                    ctx.entry_class,
                    0,
                    "no attention class calls ALL_ATTENTION_FUNCTIONS / "
                    "eager_attention_forward; custom attention code paths are not converted",
                )
            return module
        if any("Attention" in top_level_names(s) for s in module.body):  # GPT-1's, hiding the runtime's
            model = re.sub(r"(ForCausalLM|LMHeadModel|Model)$", "", ctx.entry_class) or "Model"
            module = m.replace(module, m.Name("Attention"), cst.Name(f"{model}Attention"))
            # findings on the renamed class name the line the original stands on
            ctx.scope_lines[f"{model}Attention"] = ctx.scope_lines.get("Attention", 0)
            attn = attention_classes(module, ctx.entry_class)
        module = module.visit(_Classes(ctx, attn, class_table_members(module, set(classes(module)))))
        imports = [
            ("runtime.layers.attention", "Attention"),
            ("runtime.engine.forward_metadata", "ForwardMetaData"),
        ]
        if "alibi_slopes=alibi_slopes(" in module.code:
            imports.append(("runtime.layers.attention", "alibi_slopes"))
        self.add_needed_imports(imports)
        return module
