"""The entry class's LM head is sharded by vocab rows in lmhead_tp_group: ParallelLMHead (which gathers the
logits), its weight tie becomes `tie_weights`. Its forward feeds the model this rank's chunk of the input ids
(`own_chunk`: the whole input unless the step's token layout is sharded) and gathers the hidden states onto every
rank before the last-token selection. A head tied to an embedding that stayed replicated stays replicated too. A
head built inside a module of its own (BertGeneration's `lm_head.decoder`) is sharded there, the entry's ties
rewritten to match (its bias tied to the module's `bias`, which becomes the head's). A head that is an in-file
subclass of nn.Linear (Dory's, which scales each logit by a learned factor per vocabulary entry) becomes a subclass
of ParallelLMHead: its `super().forward(...)` returns the gathered logits, which its own parameters, whole on
every rank, then act on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import (
    Transformer,
    appended,
    called_name,
    classes,
    dotted,
    findall,
    kwarg,
    method,
    param_names,
    stmt,
)
from skills.migrator.rule import Rule
from skills.parallel_impl.rules._split_unit import built_classes, named_once
from skills.parallel_impl.rules._units import (
    LINEAR,
    PREFIX_IMPORT,
    Layer,
    LinearArgs,
    code,
    edit_body,
    is_docstring,
    linear_args,
    parallel_layer,
    plumbed,
    replace_classes,
    replace_methods,
    self_layers,
    self_refs,
)

if TYPE_CHECKING:
    from skills.parallel_impl.rewrite import ParallelRewriteContext

GROUP = "lmhead_tp_group"


def _self_path(path: str) -> m.Attribute:
    """`self.<path>`, path dotted (`lm_head.decoder`)."""
    node = m.Name("self")
    for part in path.split("."):
        node = m.Attribute(node, m.Name(part))
    return node


def _tie(head: str | None = None) -> m.SimpleStatementLine:
    """`self.<head>.weight = <embedding>.weight`, head dotted (when None, any layer's: `self.lm_head.decoder.weight
    = ...`)."""
    owner = _self_path(head) if head else m.Attribute(m.Name("self")) | m.Attribute(m.Attribute())
    target = m.Attribute(owner, m.Name("weight"))
    return m.SimpleStatementLine([m.Assign([m.AssignTarget(target)], m.Attribute(attr=m.Name("weight")))])


class _Tie(Transformer):
    """`self.<head>.weight = <embedding>.weight` -> `self.<head>.tie_weights(<embedding>)`."""

    def __init__(self, head: str):
        self.head = head

    def leave_SimpleStatementLine(self, original, updated):
        if not m.matches(updated, _tie(self.head)):
            return updated
        embedding = updated.body[0].value.value
        return updated.with_changes(
            body=[cst.Expr(cst.parse_expression(f"self.{self.head}.tie_weights({code(embedding)})"))]
        )


class _GatherTokens(Transformer):
    """`h[..., forward_metadata.last_token_indices]` -> `gather_tokens(h)[...]`."""

    def __init__(self):
        self.done = False

    def leave_Subscript(self, original: cst.Subscript, updated: cst.Subscript) -> cst.Subscript:
        picks_last = any("last_token_indices" in code(e) for e in updated.slice)
        if not picks_last or m.matches(updated.value, m.Call(func=m.Name("gather_tokens"))):
            return updated
        self.done = True
        return updated.with_changes(value=cst.Call(cst.Name("gather_tokens"), [cst.Arg(updated.value)]))


def _chunk_input_ids(fwd: cst.FunctionDef) -> cst.FunctionDef:
    """`<ids> = own_chunk(<ids>)` first in forward (ids: its first argument after self)."""
    params = [*fwd.params.posonly_params, *fwd.params.params]
    ids = params[1].name.value
    body = list(fwd.body.body)
    body.insert(1 if is_docstring(body[0]) else 0, stmt(f"{ids} = own_chunk({ids})\n"))
    return fwd.with_changes(body=fwd.body.with_changes(body=body))


def _parallel_embeddings(module: cst.Module) -> set[str]:
    """Attributes some class assigns a VocabParallelEmbedding to."""
    return {
        attr
        for cls in classes(module).values()
        if (init := method(cls, "__init__")) is not None
        for attr in self_layers(init, {"VocabParallelEmbedding"})
    }


def _head(init: cst.FunctionDef) -> Layer | None:
    """`self.lm_head = nn.Linear(...)`, or else the one linear of init whose output counts the vocabulary
    (GPT-NeoX's `embed_out`)."""
    linears = self_layers(init, LINEAR)
    if "lm_head" in linears:
        return linears["lm_head"]
    vocab = [h for h in linears.values() if (a := linear_args(h.call)) and "vocab_size" in a.out_features]
    return vocab[0] if len(vocab) == 1 else None


def _head_sizes(args: LinearArgs) -> list[str]:
    """ParallelLMHead's leading arguments for an nn.Linear head's: vocab, hidden, bias."""
    return [args.out_features, args.in_features, f"bias={args.bias}"]


def _parallel_head(head: Layer, args: LinearArgs) -> cst.SimpleStatementLine:
    """`self.<head> = ParallelLMHead(vocab, hidden, bias=...)` in place of the nn.Linear head."""
    return parallel_layer(head.attr, "ParallelLMHead", _head_sizes(args), GROUP, head.line)


def _nested_head(init: cst.FunctionDef, module: cst.Module) -> tuple[str, cst.ClassDef, Layer] | None:
    """(attr, class, its head) when the one module of an in-file class the entry builds as `self.<attr>` whose
    own linear counts the vocabulary (see _head) is the LM head (BertGeneration's `lm_head.decoder`), that class
    built nowhere else and not tying the head's parameters itself."""
    local = classes(module)
    found = [
        (attr, local[callee], head)
        for attr, callee in built_classes(init).items()
        if callee in local
        and (inner := method(local[callee], "__init__")) is not None
        and plumbed(inner)
        and (head := _head(inner)) is not None
    ]
    if len(found) != 1 or not named_once(module, found[0][1].name.value):
        return None
    _, owner, head = found[0]
    tied_inside = m.AssignTarget(m.Attribute(_self_path(head.attr), m.Name("weight") | m.Name("bias")))
    return None if findall(owner, tied_inside) else found[0]


LINEAR_BASES = ("nn.Linear", "torch.nn.Linear")
SUPER_INIT = m.Call(func=m.Attribute(m.Call(func=m.Name("super")), m.Name("__init__")))
# what nn.Linear has and ParallelLMHead has not, or holds a vocab shard of: read only through super().forward
LINEAR_ONLY = m.Attribute(
    m.Name("self"), m.OneOf(*map(m.Name, ("weight", "bias", "in_features", "out_features")))
)


@dataclass(frozen=True)
class _SubclassedHead:
    layer: Layer  # the entry's `self.lm_head = Head(...)`
    cls: cst.ClassDef
    init: cst.FunctionDef  # Head's __init__
    call: cst.Call  # its `super().__init__(hidden, vocab, ...)`
    args: LinearArgs


def _subclassed_head(init: cst.FunctionDef, module: cst.Module) -> _SubclassedHead | None:
    """The entry's head when it is an in-file subclass of nn.Linear alone, built there only, whose `__init__` calls
    `super().__init__(hidden, vocab, ...)` once and whose methods reach its weight, bias and sizes only through
    `super().forward(...)` and define no `reset_parameters`."""
    local = classes(module)
    heads = [h for h in self_layers(init, local).values() if h.attr == "lm_head"]
    cls = local[called_name(heads[0].call)] if heads else None
    if cls is None or [dotted(b.value) for b in cls.bases] not in ([b] for b in LINEAR_BASES):
        return None
    inner = method(cls, "__init__")
    calls = findall(inner, SUPER_INIT) if inner is not None else []
    args = linear_args(calls[0]) if len(calls) == 1 else None
    own = findall(cls, LINEAR_ONLY) or method(cls, "reset_parameters")
    if args is None or args.transposed or own or not named_once(module, cls.name.value):
        return None
    return _SubclassedHead(heads[0], cls, inner, calls[0], args)


def _shard_subclassed_head(
    cls: cst.ClassDef, init: cst.FunctionDef, module: cst.Module, ctx: ParallelRewriteContext
) -> dict[str, cst.ClassDef] | None:
    """The entry class and its head (see _subclassed_head) made a subclass of ParallelLMHead, tied as the entry
    tied it; None when there is none, the entry takes no comm_manager / prefix, or its ties are not all to
    vocab-parallel embeddings."""
    if (head := _subclassed_head(init, module)) is None or not plumbed(init):
        return None
    ties = [dotted(t.body[0].value.value) for t in findall(init, _tie(head.layer.attr))]
    if any(t.split(".")[-1] not in _parallel_embeddings(module) for t in ties):
        return None
    plumbing = ["comm_manager=comm_manager", f'tp_group="{GROUP}"', "prefix=prefix"]
    parent = f"super().__init__({', '.join([*_head_sizes(head.args), *plumbing])})"
    inner = head.init.deep_replace(head.call, cst.parse_expression(parent))
    params = [
        cst.Param(
            cst.Name(name), cst.Annotation(cst.parse_expression(kind)), default=cst.parse_expression(value)
        )
        for name, kind, value in (("comm_manager", "CommManager | None", "None"), ("prefix", "str", '""'))
        if name not in param_names(inner)
    ]
    inner = inner.with_changes(params=inner.params.with_changes(params=[*inner.params.params, *params]))
    built = head.layer.call
    for name, value in (
        ("comm_manager", "comm_manager"),
        ("prefix", f'join_prefix(prefix, "{head.layer.attr}")'),
    ):
        built = built if kwarg(built, name) else appended(built, name, value)
    init = init.deep_replace(head.layer.call, built).visit(_Tie(head.layer.attr))
    owner = replace_methods(head.cls, {"__init__": inner}).with_changes(
        bases=[cst.Arg(cst.Name("ParallelLMHead"))]
    )
    ctx.rewrites.append(
        f"{owner.name.value}: a subclass of ParallelLMHead ({GROUP}), its own parameters whole on every rank"
        + "".join(f", tied to {t} via tie_weights" for t in ties)
    )
    return {cls.name.value: replace_methods(cls, {"__init__": init}), owner.name.value: owner}


def _bias_tie(head: str) -> m.Assign:
    """`self.<head>.bias = self.<owner>.<b>`."""
    target = m.AssignTarget(m.Attribute(_self_path(head), m.Name("bias")))
    return m.Assign([target], m.Attribute(m.Attribute(m.Name("self"))))


class _BiasTie(Transformer):
    """`self.<head>.bias = self.<owner>.<b>` -> `self.<owner>.<b> = self.<head>.bias`: the owner's bias, which
    the checkpoint names, becomes the parallel head's own, a vocab shard."""

    def __init__(self, head: str):
        self.head = head

    def leave_Assign(self, original: cst.Assign, updated: cst.Assign) -> cst.Assign:
        if not m.matches(updated, _bias_tie(self.head)):
            return updated
        return updated.with_changes(
            targets=[cst.AssignTarget(updated.value)], value=updated.targets[0].target
        )


def _bias_ties(init: cst.FunctionDef, head: str) -> list[str]:
    """The attributes `self.<head>.bias = self.<owner>.<b>` ties the head's bias to (`lm_head.bias`)."""
    return [dotted(a.value).removeprefix("self.") for a in findall(init, _bias_tie(head))]


def _shard_nested_head(
    cls: cst.ClassDef, init: cst.FunctionDef, module: cst.Module, ctx: ParallelRewriteContext
) -> dict[str, cst.ClassDef] | None:
    """The entry class and the in-file head module it builds, its linear a ParallelLMHead tied as the entry tied
    it (see _nested_head), or None when there is none or it stays replicated."""
    if (nested := _nested_head(init, module)) is None:
        return None
    attr, owner, head = nested
    path, parallel = f"{attr}.{head.attr}", _parallel_embeddings(module)
    ties = [dotted(t.body[0].value.value) for t in findall(init, _tie(path))]
    biases = _bias_ties(init, path)
    args = linear_args(head.call)
    # the owner's bias the head's is tied to becomes the head's own: no other method may read it whole
    read = [b for b in biases if b.partition(".")[0] != attr or self_refs(owner, b.partition(".")[2]) != 1]
    if any(t.split(".")[-1] not in parallel for t in ties) or args is None or args.transposed or read:
        return None
    inner = edit_body(method(owner, "__init__"), {id(head.line): [_parallel_head(head, args)]})
    ctx.rewrites.append(
        f"{owner.name.value}: {head.attr} -> ParallelLMHead ({GROUP})"
        + "".join(f", tied to {t} via tie_weights" for t in ties)
        + "".join(f", its bias shared as {b}" for b in biases)
    )
    init = init.visit(_Tie(path)).visit(_BiasTie(path))
    return {
        cls.name.value: replace_methods(cls, {"__init__": init}),
        owner.name.value: replace_methods(owner, {"__init__": inner}),
    }


def _shard_head(
    cls: cst.ClassDef, module: cst.Module, ctx: ParallelRewriteContext
) -> dict[str, cst.ClassDef]:
    """The classes changed to shard the LM head (the entry's, and the head module's of a head it builds in one),
    none when it stays replicated."""
    init = method(cls, "__init__")
    head = _head(init) if init is not None else None
    parallel = _parallel_embeddings(module)
    if head is None and init is not None and (nested := _shard_nested_head(cls, init, module, ctx)):
        return nested
    if head is None and init is not None and (subclassed := _shard_subclassed_head(cls, init, module, ctx)):
        return subclassed
    if head is None:
        tied = [t for t in findall(init, _tie()) if dotted(t.body[0].value.value).split(".")[-1] in parallel]
        if tied:
            ctx.unsupported(
                cls.name.value,
                0,
                f"`{code(tied[0]).strip()}` ties a layer that is not one nn.Linear "
                "LM head to a vocab-parallel embedding",
            )
        return {}
    ties = [dotted(t.body[0].value.value) for t in findall(init, _tie(head.attr))]
    tied_parallel = [t for t in ties if t.split(".")[-1] in parallel]
    args = linear_args(head.call)
    if len(tied_parallel) != len(ties) or args is None or args.transposed or not plumbed(init):
        if tied_parallel:  # a replicated head can't share a vocab-sharded weight
            ctx.unsupported(
                cls.name.value,
                0,
                "the LM head is tied to a vocab-parallel embedding but cannot be "
                "sharded (nn.Linear arguments or constructor parameters not understood)",
            )
        return {}
    init = edit_body(init, {id(head.line): [_parallel_head(head, args)]}).visit(_Tie(head.attr))
    ctx.rewrites.append(
        f"{cls.name.value}: {head.attr} -> ParallelLMHead ({GROUP})"
        + "".join(f", tied to {t} via tie_weights" for t in ties)
    )
    return {cls.name.value: replace_methods(cls, {"__init__": init})}


class ShardLMHead(Rule):
    ID = "PR004"
    DESCRIPTION = "The LM head is sharded by vocab rows: ParallelLMHead, which gathers the logits."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        ctx = self.rewrite
        cls = classes(module).get(ctx.entry_class)
        if cls is None:
            return module
        imports = []
        changed = _shard_head(cls, module, ctx)
        if changed:
            imports += [("runtime.layers.embedding", "ParallelLMHead"), PREFIX_IMPORT]
        if any(m.matches(b, m.Arg(m.Name("ParallelLMHead"))) for c in changed.values() for b in c.bases):
            imports.append(("runtime.config.comm_manager", "CommManager"))  # a subclassed head's parameter
        new = changed.get(cls.name.value, cls)
        fwd = method(new, "forward")
        if fwd is not None and (changed or "tp_group=" in module.code):  # some layer is parallel
            gather = _GatherTokens()
            new_fwd = fwd.visit(gather)
            if gather.done:
                new = replace_methods(new, {"forward": _chunk_input_ids(new_fwd)})
                ctx.rewrites.append(
                    f"{cls.name.value}: forward feeds the model this rank's chunk of the input ids and gathers the "
                    "tokens of every rank before the LM head"
                )
                imports += [
                    ("runtime.layers.token_layout", "gather_tokens"),
                    ("runtime.layers.token_layout", "own_chunk"),
                ]
            elif not findall(fwd, m.Call(func=m.Name("gather_tokens"))):
                ctx.unsupported(
                    cls.name.value,
                    0,
                    "forward has no `[..., forward_metadata.last_token_indices]` "
                    "selection to gather the tokens of every rank before the LM head",
                )
        if not imports:
            return module
        self.add_needed_imports(imports)
        return replace_classes(module, {**changed, cls.name.value: new})
