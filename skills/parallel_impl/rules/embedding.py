"""Token embeddings (`nn.Embedding` whose size mentions `vocab_size`) are sharded by vocab rows in
embed_tp_group: VocabParallelEmbedding. padding_idx only matters for training and is dropped (with the
local that held it, when nothing else reads it). Other
embeddings, and those of classes without the migrated plumbing, stay replicated (still correct).

A learned position table (an `nn.Embedding`, or an in-file subclass of it: OPT's and BioGPT's add an offset)
looked up with forward's `position_ids` (GPT-2's `self.wpe(position_ids)`, TrOCR's `self.embed_positions(input,
position_ids=position_ids[0])`), or another in-file module looked up
so, or a tensor indexed so, whose rows forward adds to others (XGLM's sinusoidal module, CTRL's sinusoidal
buffer), looks up this rank's chunk of them, `own_chunk(position_ids)`, as the entry does the input ids: its rows
join the token embeddings, which a rank holds only its chunk of when the step's token layout is sharded
(attention DP)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import assigned_names, classes, code, dotted, findall, method, param_names
from skills.migrator.rule import Rule
from skills.migrator.rules.dead_code import drop_dead_locals
from skills.parallel_impl.rules._units import (
    EMBEDDING,
    PREFIX_IMPORT,
    edit_body,
    parallel_layer,
    plain_args,
    plumbed,
    replace_by_id,
    replace_classes,
    replace_methods,
    self_layers,
)

if TYPE_CHECKING:
    from skills.parallel_impl.rewrite import ParallelRewriteContext

GROUP = "embed_tp_group"
POSITIONS = "position_ids"  # the runtime contract's name for each token's position
ARGS = ("num_embeddings", "embedding_dim", "padding_idx")


def _is_vocab(args: dict[str, str] | None) -> bool:
    return bool(args) and "vocab_size" in args.get("num_embeddings", "") and "embedding_dim" in args


def _joins_sum(fwd: cst.FunctionDef, lookup: cst.BaseExpression) -> bool:
    """lookup's rows are an operand of a `+` in fwd as they are (`.to(...)` aside), directly or through the name
    it is bound to; not when multiplied first, as rotary cos / sin are."""
    bound: set[str] = set()

    def carried(node: cst.BaseExpression) -> bool:
        while node is not lookup and isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
            node = node.func.value  # `rows.to(device)`
        return node is lookup or (isinstance(node, cst.Name) and node.value in bound)

    for a in findall(fwd, m.Assign([m.AssignTarget(m.Name())])):
        if carried(a.value):
            bound.add(a.targets[0].target.value)
    return any(
        carried(op.left) or carried(op.right) for op in findall(fwd, m.BinaryOperation(operator=m.Add()))
    )


def _chunked_positions(
    cls: cst.ClassDef, ctx: ParallelRewriteContext, kinds: frozenset[str], modules: frozenset[str]
) -> cst.ClassDef | None:
    """cls with its position tables looked up on this rank's chunk of forward's `position_ids`, None if none:
    those built by one of kinds (nn.Embedding or an in-file subclass of it, OPT's offset table) whatever forward
    does with their rows; those built by another in-file module of modules (XGLM's sinusoidal table) or held as a
    tensor indexed by the positions (CTRL's `self.pos_encoding[position_ids, :]`) when forward adds their rows to
    others, unlike rotary embeddings, whose cos / sin attention reads over the whole sequence."""
    init, fwd = method(cls, "__init__"), method(cls, "forward")
    if (
        init is None
        or fwd is None
        or POSITIONS not in param_names(fwd)
        or POSITIONS in assigned_names(fwd.body)
    ):
        return None
    tables = [
        a for a, layer in self_layers(init, kinds).items() if not _is_vocab(plain_args(layer.call, ARGS))
    ]
    others = [a for a in self_layers(init, modules) if a not in tables]
    positions = m.Name(POSITIONS)
    given = m.Arg(positions | m.Subscript(positions))  # `position_ids=position_ids[0]` too (TrOCR's, one row)
    by_table = m.Call(
        m.Attribute(m.Name("self"), m.OneOf(*map(m.Name, tables))), [m.ZeroOrMore(), given, m.ZeroOrMore()]
    )
    by_module = m.Call(
        m.Attribute(m.Name("self"), m.OneOf(*map(m.Name, others))), [m.Arg(positions), m.ZeroOrMore()]
    )
    indexed = m.Subscript(
        m.Attribute(m.Name("self"), m.Name()), [m.SubscriptElement(m.Index(positions)), m.ZeroOrMore()]
    )
    summed = m.OneOf(indexed, by_module) if others else indexed
    lookups = findall(fwd, by_table) if tables else []
    lookups += [x for x in findall(fwd, summed) if _joins_sum(fwd, x)]
    if not lookups:
        return None
    chunked = cst.parse_expression(f"own_chunk({POSITIONS})")
    new = {}
    for x in lookups:
        if isinstance(x, cst.Call):
            i = next(i for i, a in enumerate(x.args) if m.matches(a, given))
            value = x.args[i].value
            value = chunked if isinstance(value, cst.Name) else value.with_changes(value=chunked)
            new[id(x)] = x.with_changes(
                args=[*x.args[:i], x.args[i].with_changes(value=value), *x.args[i + 1 :]]
            )
        else:
            first = x.slice[0].with_changes(slice=cst.Index(chunked))
            new[id(x)] = x.with_changes(slice=[first, *x.slice[1:]])
    ctx.rewrites += [
        f"{cls.name.value}: {code(x.value if isinstance(x, cst.Subscript) else x.func)} looks up this rank's "
        f"chunk of {POSITIONS}"
        for x in lookups
    ]
    return replace_methods(cls, {"forward": replace_by_id(fwd, new)})


def _rewrite(cls: cst.ClassDef, ctx: ParallelRewriteContext) -> cst.ClassDef | None:
    init = method(cls, "__init__")
    if init is None or not plumbed(init):
        return None
    changes = {}
    for attr, layer in self_layers(init, EMBEDDING).items():
        args = plain_args(layer.call, ARGS)
        if _is_vocab(args):
            changes[id(layer.line)] = [
                parallel_layer(
                    attr,
                    "VocabParallelEmbedding",
                    [args["num_embeddings"], args["embedding_dim"]],
                    GROUP,
                    layer.line,
                )
            ]
            ctx.rewrites.append(f"{cls.name.value}: {attr} -> VocabParallelEmbedding ({GROUP})")
    return replace_methods(cls, {"__init__": drop_dead_locals(edit_body(init, changes))}) if changes else None


class ShardEmbedding(Rule):
    ID = "PR003"
    DESCRIPTION = "Token embeddings are sharded by vocab rows: VocabParallelEmbedding (embed_tp_group)."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        ctx = self.rewrite
        new = {
            name: result
            for name, cls in classes(module).items()
            if (result := _rewrite(cls, ctx)) is not None
        }
        if new:
            self.add_needed_imports([("runtime.layers.embedding", "VocabParallelEmbedding"), PREFIX_IMPORT])
            module = replace_classes(module, new)
        local = classes(module)
        tables = EMBEDDING | {
            n for n, c in local.items() if any(dotted(b.value) in EMBEDDING for b in c.bases)
        }
        positions = {
            name: result
            for name, cls in local.items()
            if (result := _chunked_positions(cls, ctx, tables, frozenset(local))) is not None
        }
        if positions:
            self.add_needed_imports([("runtime.layers.token_layout", "own_chunk")])
            module = replace_classes(module, positions)
        return module
