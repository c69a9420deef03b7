"""The `skill parallelize` rewrite rules, one codemod per file, in the order they are applied: the checkpoint's
untaken config branches guarded, layers, then the entry class's comm groups (collected from the layers) and weight
loading (from the fusions made)."""

from skills.parallel_impl.rules.attention import ShardAttention
from skills.parallel_impl.rules.checkpoint_branches import GuardUntakenBranches
from skills.parallel_impl.rules.comm_groups import RegisterCommGroups
from skills.parallel_impl.rules.embedding import ShardEmbedding
from skills.parallel_impl.rules.experts import ShardExperts
from skills.parallel_impl.rules.lm_head import ShardLMHead
from skills.parallel_impl.rules.mlp import ShardMLP
from skills.parallel_impl.rules.stacked_params import StackedParams

PARALLEL_RULES = [
    GuardUntakenBranches,
    ShardAttention,
    ShardMLP,
    ShardExperts,
    ShardEmbedding,
    ShardLMHead,
    RegisterCommGroups,
    StackedParams,
]
