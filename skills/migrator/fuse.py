"""Fused projections in what `skill migrate` writes: the runtime's parallel layers, at TP 1 as at any TP size.

The rules leave one `nn.Linear` per checkpoint tensor. `skill parallelize`'s rewrite, which does not depend on a
parallel config, makes q/k/v one QKVParallelLinear and gate/up one MergedColumnParallelLinear (seed 002 wraps
every linear in the parallel family even at tp=1), so a single-rank step runs one GEMM for each: on the SmolLM2
export (bf16, 2 threads) a batch-1 decode step takes 29 ms instead of 36. models/ gets that code and
agentic/migrated_models/ the per-projection one, which `skill parallelize` starts from. A model the parallel rules
refuse, or with nothing to fuse, keeps its per-projection code."""

from dataclasses import dataclass
from pathlib import Path

from skills.parallel_impl.pipeline import PRISTINE
from skills.parallel_impl.rewrite import rewrite_sources


@dataclass
class Fusion:
    files: dict[str, str]  # models/*.py (and agentic/migrated_models/*.py when fused) -> code
    rules: dict[str, list[str]]  # models/*.py -> ids of the migrate, then the parallel rules that changed it
    fused: list[str]  # "qkv_proj (q_proj, k_proj, v_proj)", one per fused attribute
    note: str  # what happened, for the log and the result's notes


def fuse_projections(files: dict[str, str], rules: dict[str, list[str]], entry_class: str) -> Fusion:
    """`files` / `rules` as convert_code made them (keys models/<file>.py)."""
    models = {Path(rel).name: text for rel, text in files.items()}
    code = rewrite_sources(models, entry_class)
    if code.findings:
        why = "; ".join(f.what for f in code.findings)
        return Fusion(files, rules, [], f"kept one linear layer per checkpoint tensor: {why}")
    if not code.fused:
        return Fusion(files, rules, [], "kept one linear layer per checkpoint tensor: no projections to fuse")
    fused = [f"{attr} ({', '.join(parts)})" for attr, parts in code.fused.items()]
    return Fusion(
        {
            **{f"models/{name}": text for name, text in code.files.items()},
            **{f"{PRISTINE.as_posix()}/{name}": text for name, text in models.items()},
        },
        {rel: [*ids, *code.rules.get(rel, [])] for rel, ids in rules.items()},
        fused,
        f"parallel layers at TP 1, fused projections: {', '.join(fused)}",
    )
