"""Token embeddings (`nn.Embedding` whose size mentions `vocab_size`) are sharded by vocab rows in
embed_tp_group: VocabParallelEmbedding. padding_idx only matters for training and is dropped (with the
local that held it, when nothing else reads it). Other
embeddings, and those of classes without the migrated plumbing, stay replicated (still correct)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import libcst as cst

from skills.migrator.cst_utils import classes, method
from skills.migrator.rule import Rule
from skills.migrator.rules.dead_code import drop_dead_locals
from skills.parallel_impl.rules._units import (
    EMBEDDING,
    PREFIX_IMPORT,
    edit_body,
    parallel_layer,
    plain_args,
    plumbed,
    replace_classes,
    replace_methods,
    self_layers,
)

if TYPE_CHECKING:
    from skills.parallel_impl.rewrite import ParallelRewriteContext

GROUP = "embed_tp_group"
ARGS = ("num_embeddings", "embedding_dim", "padding_idx")


def _rewrite(cls: cst.ClassDef, ctx: ParallelRewriteContext) -> cst.ClassDef | None:
    init = method(cls, "__init__")
    if init is None or not plumbed(init):
        return None
    changes = {}
    for attr, layer in self_layers(init, EMBEDDING).items():
        args = plain_args(layer.call, ARGS)
        if args and "vocab_size" in args.get("num_embeddings", "") and "embedding_dim" in args:
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
        if not new:
            return module
        self.add_needed_imports([("runtime.layers.embedding", "VocabParallelEmbedding"), PREFIX_IMPORT])
        return replace_classes(module, new)
