"""`skill parallelize`'s code rewrite: a migrated modeling file (plain nn.Linear / nn.Embedding) becomes a
tensor-parallel one built from the runtime's parallel layers.

The output does not depend on a parallel_config: every layer reads its TP size from its comm group at run time
(a group that is not registered means TP 1), so one rewrite serves every configuration.
"""

from collections.abc import Collection
from dataclasses import dataclass, field

from skills.migrator.context import RewriteContext
from skills.migrator.rewrite import rewrite
from skills.parallel_impl.rules import PARALLEL_RULES

ShardId = str | int
# (fused param, checkpoint part, shard_id), as load_named_weights takes them
StackedParam = tuple[str, str, ShardId]


@dataclass
class ParallelRewriteContext(RewriteContext):
    """RewriteContext (entry_class, filename, findings, `unsupported`) plus what the parallel rules did."""

    # one line per change, e.g. "LlamaMLP: down_proj -> RowParallelLinear (dense_tp_group)"
    rewrites: list[str] = field(default_factory=list)
    # the stacked_params_mapping entries of the fusions made, e.g. (".qkv_proj", ".q_proj", "q")
    fused: list[StackedParam] = field(default_factory=list)


def parallelize_source(source: str, ctx: ParallelRewriteContext, disabled: Collection[str] = ()) -> str:
    """The rewritten source; anything the rules could not shard safely is in ctx.findings."""
    return rewrite(source, ctx, PARALLEL_RULES, disabled)
