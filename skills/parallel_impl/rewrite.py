"""`skill parallelize`'s code rewrite: a migrated modeling file (plain nn.Linear / nn.Embedding) becomes a
tensor-parallel one built from the runtime's parallel layers.

The output does not depend on a parallel_config: every layer reads its TP size from its comm group at run time
(a group that is not registered means TP 1), so one rewrite serves every configuration.
"""

from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from typing import Any

from skills.codegen_cache import cached, config_key
from skills.migrator.codestyle import tidy
from skills.migrator.context import Finding, RewriteContext
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
    # attention the rules cannot shard runs whole on every rank (ReplicatedRegion) instead of being a finding
    replicate_attention: bool = False
    replicated: list[str] = field(default_factory=list)  # the classes that do
    head_groups: int = 1  # runs of heads QKVParallelLinear splits each of (DiffLlama's 2)


def parallelize_source(source: str, ctx: ParallelRewriteContext, disabled: Collection[str] = ()) -> str:
    """The rewritten source; anything the rules could not shard safely is in ctx.findings."""
    return rewrite(source, ctx, PARALLEL_RULES, disabled)


@dataclass
class ParallelCode:
    files: dict[str, str]  # every file given, the modeling_*.py ones rewritten
    rewrites: list[str]  # what changed, one line each
    fused: dict[str, tuple[str, ...]]  # fused attribute -> its checkpoint parts: qkv_proj -> (q_proj, ...)
    rules: dict[str, list[str]]  # models/<file> -> ids of the rules that changed it
    findings: list[Finding]  # what the rules could not shard safely; the files are not usable when any
    replicated: list[str]  # attention classes run whole on every rank (--replicate-attention)
    head_groups: int = 1  # runs of heads the q/k/v layers split each of


def rewrite_sources(
    sources: dict[str, str],
    entry_class: str,
    disabled: Collection[str] = (),
    checkpoint_config: Any = None,
    replicate_attention: bool = False,
) -> ParallelCode:
    """The parallel rewrite of a model's files (name -> text); only modeling_*.py files change. With the
    checkpoint's config, the branches it never takes are guarded first (PR008)."""

    def compute() -> ParallelCode:
        code = ParallelCode(dict(sources), [], {}, {}, [], [])
        for name, text in sources.items():
            if not name.startswith("modeling_"):
                continue
            ctx = ParallelRewriteContext(
                entry_class=entry_class,
                filename=name,
                checkpoint_config=checkpoint_config,
                replicate_attention=replicate_attention,
            )
            code.files[name] = tidy(parallelize_source(text, ctx, disabled), name)
            code.rules[f"models/{name}"] = ctx.applied
            code.findings += ctx.findings
            code.replicated += ctx.replicated
            code.head_groups = max(code.head_groups, ctx.head_groups)
            code.rewrites += ctx.rewrites
            for attr, part, _ in ctx.fused:
                key = attr.lstrip(".")
                code.fused[key] = (*code.fused.get(key, ()), part.lstrip("."))
        return code

    inputs = [sources, entry_class, sorted(disabled), config_key(checkpoint_config), replicate_attention]
    return cached("parallelize", inputs, compute, asdict, _parallel_code)


def _parallel_code(stored: dict) -> ParallelCode:
    return ParallelCode(
        **{
            **stored,
            "fused": {attr: tuple(parts) for attr, parts in stored["fused"].items()},
            "findings": [Finding(**f) for f in stored["findings"]],
        }
    )
