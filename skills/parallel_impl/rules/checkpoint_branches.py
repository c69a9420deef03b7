"""Before any layer is sharded, every config branch the checkpoint never takes becomes a guard (the migrator's
MG018 keeps the harmless ones general): a module such a branch builds (Cohere's and StableLM's per-head q / k
norms, off under `use_qk_norm` / `qk_layernorm`) is never built for this checkpoint and needs no sharding, and
the parallel code, bound to this checkpoint's layout, refuses one that takes the branch instead of running it with
whole layers."""

import libcst as cst

from skills.migrator.rule import Rule
from skills.migrator.rules.checkpoint_branches import guard_untaken_branches

GUARD = (
    "parallelized for a checkpoint where `{test}` is false; ",
    "run `skill migrate` and `skill parallelize` on this checkpoint",
)


class GuardUntakenBranches(Rule):
    ID = "PR008"
    DESCRIPTION = (
        "Config branches the checkpoint never takes become guards, so no rule shards what they build."
    )

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        return guard_untaken_branches(module, self.rewrite.checkpoint_config, None, GUARD)
