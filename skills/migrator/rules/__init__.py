"""The rewrite rules, one per file, in the order the migrator applies them."""
from skills.migrator.rules import (
    absolute_imports,
    causal_lm_entry,
    classvar_annotations,
    constructor_plumbing,
    dead_code,
    drop_dropout,
    fold_hf_only_params,
    model_outputs,
    module_bases,
    prune_unreachable,
    remove_mask_machinery,
    runtime_attention,
    strip_hf_decorators,
    unused_imports,
)

MODELING_RULES = [
    absolute_imports, strip_hf_decorators, remove_mask_machinery, fold_hf_only_params, runtime_attention,
    model_outputs, causal_lm_entry, module_bases, drop_dropout, constructor_plumbing, prune_unreachable,
    dead_code, unused_imports,
]
CONFIGURATION_RULES = [absolute_imports, strip_hf_decorators, classvar_annotations, unused_imports]
