"""The entry class's LM head is sharded by vocab rows in lmhead_tp_group: ParallelLMHead (which gathers the
logits), its weight tie becomes `tie_weights`. Its forward feeds the model this rank's chunk of the input ids
(`own_chunk`: the whole input unless the step's token layout is sharded) and gathers the hidden states onto every
rank before the last-token selection. A head tied to an embedding that stayed replicated stays replicated too."""

from __future__ import annotations

from typing import TYPE_CHECKING

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import classes, dotted, method, stmt
from skills.migrator.rule import Rule
from skills.parallel_impl.rules._units import (
    LINEAR,
    PREFIX_IMPORT,
    Layer,
    code,
    edit_body,
    is_docstring,
    linear_args,
    parallel_layer,
    plumbed,
    replace_classes,
    replace_methods,
    self_layers,
)

if TYPE_CHECKING:
    from skills.parallel_impl.rewrite import ParallelRewriteContext

GROUP = "lmhead_tp_group"


def _tie(head: str | None = None) -> m.SimpleStatementLine:
    """`self.<head>.weight = <embedding>.weight` (any head when None)."""
    target = m.Attribute(m.Attribute(m.Name("self"), m.Name(head) if head else m.Name()), m.Name("weight"))
    return m.SimpleStatementLine([m.Assign([m.AssignTarget(target)], m.Attribute(attr=m.Name("weight")))])


class _Tie(cst.CSTTransformer):
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


class _GatherTokens(cst.CSTTransformer):
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


def _shard_head(cls: cst.ClassDef, module: cst.Module, ctx: ParallelRewriteContext) -> cst.ClassDef:
    """The entry class with a ParallelLMHead, or cls itself when its head stays replicated."""
    init = method(cls, "__init__")
    head = _head(init) if init is not None else None
    parallel = _parallel_embeddings(module)
    if head is None:
        tied = [
            t for t in m.findall(init, _tie()) if dotted(t.body[0].value.value).split(".")[-1] in parallel
        ]
        if tied:
            ctx.unsupported(
                cls.name.value,
                0,
                f"`{code(tied[0]).strip()}` ties a layer that is not one nn.Linear "
                "LM head to a vocab-parallel embedding",
            )
        return cls
    ties = [dotted(t.body[0].value.value) for t in m.findall(init, _tie(head.attr))]
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
        return cls
    new = parallel_layer(
        head.attr,
        "ParallelLMHead",
        [args.out_features, args.in_features, f"bias={args.bias}"],
        GROUP,
        head.line,
    )
    init = edit_body(init, {id(head.line): [new]}).visit(_Tie(head.attr))
    ctx.rewrites.append(
        f"{cls.name.value}: {head.attr} -> ParallelLMHead ({GROUP})"
        + "".join(f", tied to {t} via tie_weights" for t in ties)
    )
    return replace_methods(cls, {"__init__": init})


class ShardLMHead(Rule):
    ID = "PR004"
    DESCRIPTION = "The LM head is sharded by vocab rows: ParallelLMHead, which gathers the logits."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        ctx = self.rewrite
        cls = classes(module).get(ctx.entry_class)
        if cls is None:
            return module
        imports = []
        new = _shard_head(cls, module, ctx)
        if new is not cls:
            imports += [("runtime.layers.embedding", "ParallelLMHead"), PREFIX_IMPORT]
        fwd = method(new, "forward")
        if fwd is not None and (new is not cls or "tp_group=" in module.code):  # some layer is parallel
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
            elif not m.findall(fwd, m.Call(func=m.Name("gather_tokens"))):
                ctx.unsupported(
                    cls.name.value,
                    0,
                    "forward has no `[..., forward_metadata.last_token_indices]` "
                    "selection to gather the tokens of every rank before the LM head",
                )
        if not imports:
            return module
        self.add_needed_imports(imports)
        return replace_classes(module, {cls.name.value: new})
