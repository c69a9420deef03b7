"""The `skill parallelize` rewrite rules, one per file, in the order they are applied: layers first, then the
entry class's comm groups (collected from the layers) and weight loading (from the fusions made)."""

from skills.parallel_impl.rules import attention, comm_groups, embedding, lm_head, mlp, stacked_params

PARALLEL_RULES = [attention, mlp, embedding, lm_head, comm_groups, stacked_params]
