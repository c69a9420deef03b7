"""Token embeddings (`nn.Embedding` whose size mentions `vocab_size`) are sharded by vocab rows in
embed_tp_group: VocabParallelEmbedding. padding_idx only matters for training and is dropped (with the
local that held it, when nothing else reads it). Other
embeddings, and those of classes without the migrated plumbing, stay replicated (still correct).

A learned position table (an `nn.Embedding`, or an in-file subclass of it: OPT's and BioGPT's add an offset)
looked up with forward's `position_ids` (GPT-2's `self.wpe(position_ids)`), or another in-file module looked up
so whose rows forward adds to others (XGLM's sinusoidal table), looks up this rank's chunk of them, `own_chunk(position_ids)`, as the entry does the input ids: its rows join the token
embeddings, which a rank holds only its chunk of when the step's token layout is sharded (attention DP)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import assigned_names, classes, code, dotted, method, param_names
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


def _joins_sum(fwd: cst.FunctionDef, call: cst.Call) -> bool:
    """call's result is an operand of a `+` in fwd, directly or through the name it is bound to."""
    bound = {
        t.target.value
        for a in m.findall(fwd, m.Assign())
        if any(c is call for c in m.findall(a.value, m.Call()))
        for t in a.targets
        if isinstance(t.target, cst.Name)
    }
    for op in m.findall(fwd, m.BinaryOperation(operator=m.Add())):
        for side in (op.left, op.right):
            if any(c is call for c in m.findall(side, m.Call())) or bound & {
                n.value for n in m.findall(side, m.Name())
            }:
                return True
    return False


def _chunked_positions(
    cls: cst.ClassDef, ctx: ParallelRewriteContext, kinds: frozenset[str], modules: frozenset[str]
) -> cst.ClassDef | None:
    """cls with its position tables looked up on this rank's chunk of forward's `position_ids`, None if none:
    those built by one of kinds (nn.Embedding or an in-file subclass of it, OPT's offset table), and those built
    by another in-file module of modules whose rows forward adds to others (XGLM's sinusoidal table), unlike
    rotary embeddings, whose cos / sin attention reads over the whole sequence."""
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
    calls = []
    for attrs, summed in ((tables, False), (others, True)):
        by_position = m.Call(
            m.Attribute(m.Name("self"), m.OneOf(*map(m.Name, attrs))),
            [m.Arg(m.Name(POSITIONS)), m.ZeroOrMore()],
        )
        found = m.findall(fwd, by_position) if attrs else []
        calls += [c for c in found if not summed or _joins_sum(fwd, c)]
    if not calls:
        return None
    chunked = cst.parse_expression(f"own_chunk({POSITIONS})")
    new = {id(c): c.with_changes(args=[c.args[0].with_changes(value=chunked), *c.args[1:]]) for c in calls}
    ctx.rewrites += [
        f"{cls.name.value}: {code(c.func)} looks up this rank's chunk of {POSITIONS}" for c in calls
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
