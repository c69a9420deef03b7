"""`skill parallelize`: validate the config, rewrite the migrated code to parallel layers, write the scenario YAML.

The rewrite always starts from the code `skill migrate` wrote (kept in agentic/migrated_models/ on the first run)
and does not depend on the config: sizes are read from the comm groups at run time, so every scenario YAML runs
the same code. Everything is checked before a file changes: the config against the model's shapes, the rewritten
code by building every rank's shards on the meta device, whose parameter bytes must equal the plan's.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import shutil
import tempfile
from collections.abc import Callable, Collection
from pathlib import Path

import torch
import yaml
from transformers import PretrainedConfig

from runtime.config import InferenceConfig, ParallelConfig
from runtime.config.comm_manager import CommManager
from runtime.engine.model_worker import ModelWorker, default_dtype, param_bytes
from runtime.engine.registry import resolve_model
from runtime.errors import ConfigError, UserError
from runtime.layers.attention import cache_info_of
from runtime.layers.token_layout import needs_sharded_layout
from runtime.layers.weights import tie_declared_weights
from skills.atomic_write import UMASK, write_text_atomic
from skills.migrator.rewrite import check_rule_ids
from skills.migrator.rules.causal_lm_entry import LAST_POSITIONS_SEQ_FIRST
from skills.parallel_impl.config import load_parallel_config, yaml_name
from skills.parallel_impl.model_sizes import with_standard_sizes
from skills.parallel_impl.plan import COLUMN_QKV, MLP_LAYERS, WHOLE, Plan, make_plan, validate
from skills.parallel_impl.rewrite import rewrite_sources
from skills.parallel_impl.rules import PARALLEL_RULES
from skills.parallel_impl.rules.attention import FUSED_ON_DISK, QKV
from skills.parallel_impl.scenario import scenario_yaml

PRISTINE = Path("agentic") / "migrated_models"
_PARALLEL = frozenset(
    {
        "QKVParallelLinear",
        "MergedColumnParallelLinear",
        "ColumnParallelLinear",
        "RowParallelLinear",
        "OProjParallelLinear",
        "VocabParallelEmbedding",
        "ParallelLMHead",
        "shard_heads",
    }
)
_EXPERTS = "= ExpertParallel("  # an experts module split over moe_ep_group (rules/experts.py)
_EXPERTS_TP = 'tp_group="moe_tp_group"'  # ... and over moe_tp_group
_INFER_SH_YAML = re.compile(r'^YAML="\$\{YAML:-\$DIR/[^}]*\}"$', re.MULTILINE)


@dataclasses.dataclass
class ParallelizeResult:
    model_dir: str
    yaml: str
    world_size: int
    groups: list[dict]
    rewrites: list[str]  # the plan's steps, then what the code rules changed
    per_rank_param_bytes: int
    total_param_bytes: int
    kv_bytes_per_token: int  # KV cache bytes one token takes on a rank, all layers
    written: list[str]
    rules: dict[str, list[str]]  # rewritten file -> ids of the rules that changed it

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def base_yaml(model_dir: Path) -> Path:
    """The YAML `skill migrate` wrote: config/<dir name>.yaml."""
    path = model_dir / "config" / f"{model_dir.name}.yaml"
    if not path.is_file():
        raise UserError(
            f"{path} does not exist; pass a model directory written by `skill migrate` (it holds "
            "config/<name>.yaml, models/ and infer.sh)."
        )
    return path


def directory_mode(model_dir: Path) -> str:
    return "standalone" if (model_dir / "infer.py").is_file() else "framework"


def _migrated_sources(model_dir: Path) -> dict[str, str]:
    """models/*.py as `skill migrate` wrote them: the pristine copy when a previous run kept one."""
    pristine = model_dir / PRISTINE
    folder = pristine if pristine.is_dir() else model_dir / "models"
    files = {p.name: p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.py"))}
    if not any(name.startswith("modeling_") for name in files):
        raise UserError(
            f"{folder} holds no modeling_*.py; pass a model directory written by `skill migrate`."
        )
    return files


def _measure(model_dir: Path, config: InferenceConfig, world_size: int) -> list[tuple[int, int]]:
    """(parameter bytes, KV cache bytes per token) of each rank, from the model built on the meta device with that
    rank's shards."""
    model_cls, hf_config = ModelWorker(config, None, model_dir).model_class_and_config()
    sizes = []
    for rank in range(world_size):
        with torch.device("meta"), default_dtype(config.model_config.torch_dtype):
            model = model_cls(
                hf_config, config, CommManager(world_size, rank, create_groups=False), prefix=""
            )
        tie_declared_weights(model)  # as loading shares them
        kv = cache_info_of(model, config.model_config.torch_dtype).bytes_per_block(1)  # one token, all layers
        sizes.append((param_bytes(model), kv))
    return sizes


def _measured_plan(t: _Target, config: InferenceConfig) -> Plan:
    """The plan with the KV cache bytes per token of a rank, once every rank of the rewritten model (built on the
    meta device from a staged copy, with `config`, the scenario's) holds exactly the plan's parameter bytes."""
    config.model_config.trust_remote_code = True  # our own rewritten code, built on the meta device only
    with tempfile.TemporaryDirectory(prefix=".parallelize.", dir=t.model_dir.parent) as tmp:
        staged = Path(tmp) / t.model_dir.name
        (staged / "models").mkdir(parents=True)
        for name, text in t.new_code.items():
            (staged / "models" / name).write_text(text, encoding="utf-8")
        measured = _measure(staged, config, t.plan.world_size)
        resolve_model.cache_clear()
    held = [p for p, _ in measured]
    if any(p != t.plan.per_rank_param_bytes for p in held):
        raise UserError(
            f"the rewritten model holds {held} parameter bytes on ranks 0..{t.plan.world_size - 1}, "
            f"but the plan expects {t.plan.per_rank_param_bytes} on each: a module was not sharded as "
            "planned. Nothing was written; please report this model."
        )
    return dataclasses.replace(t.plan, kv_bytes_per_token=max(kv for _, kv in measured))


def _as_migrated(sources: dict[str, str], entry_class: str) -> dict[str, str]:
    """models/*.py as `skill migrate` writes them (fused at TP 1, without the checkpoint's config: see
    skills/migrator/fuse.py), to tell them from a user's edits."""
    code = rewrite_sources(sources, entry_class)
    return sources if code.findings or not code.fused else code.files


def _refuse_overwrite(path: Path, new: str, allowed: tuple[str, ...], force: bool) -> None:
    if force or not path.exists():
        return
    current = path.read_text(encoding="utf-8")
    if current != new and current not in allowed:
        raise UserError(
            f"{path} was changed after `skill migrate` / `skill parallelize` wrote it; pass --force "
            "to overwrite it (your edits there would be lost)."
        )


@dataclasses.dataclass
class _Target:
    model_dir: Path
    pc: ParallelConfig
    yaml_path: Path  # the migrated YAML
    config: InferenceConfig
    model_cls: type[torch.nn.Module]  # the entry class of models/ as it is now
    hf_config: PretrainedConfig
    plan: Plan
    sources: dict[str, str]  # models/*.py as migrated
    new_code: dict[str, str]  # the same files rewritten
    code_rewrites: list[str]
    rules: dict[str, list[str]]


def _self_calls(tree: ast.AST, ctors: Collection[str], qualified: bool = False) -> dict[str, ast.Call]:
    """x -> the first call of one of ctors in the value of each `self.x = ...` under tree (a parallel layer, also
    as one branch of a conditional); qualified: also `module.ctor(...)` (`nn.Linear`)."""
    found = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        calls = [
            c
            for c in ast.walk(node.value)
            if isinstance(c, ast.Call)
            and (
                (isinstance(c.func, ast.Name) and c.func.id in ctors)
                or (qualified and isinstance(c.func, ast.Attribute) and c.func.attr in ctors)
            )
        ]
        for target in node.targets:
            if calls and isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self":
                found[target.attr] = calls[0]
    return found


# a pattern MG024 gives `load_named_weights(..., ignored=[...])`: `(^|\.)crossattention\.`
UNREAD_MODULE = re.compile(r"\(\^\|\\\.\)\w+\\\.")


def _unloaded(new_code: dict[str, str]) -> tuple[str, ...]:
    """The modules transformers builds that the migrated model does not (TrOCR's cross-attention), which no rank
    holds: MG024's patterns among those `load_named_weights(..., ignored=[...])` skips, which name no module in
    use (transformers' own, such as GPT-2's `attn.bias`, may match a parameter the model does take)."""
    found = []
    for text in new_code.values():
        for call in ast.walk(ast.parse(text)):
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "load_named_weights":
                lists = [
                    k.value for k in call.keywords if k.arg == "ignored" and isinstance(k.value, ast.List)
                ]
                found += [e.value for v in lists for e in v.elts if isinstance(e, ast.Constant)]
    return tuple(p for p in found if isinstance(p, str) and UNREAD_MODULE.fullmatch(p))


def _layers(
    new_code: dict[str, str], fused: dict[str, tuple[str, ...]]
) -> tuple[frozenset[str], dict[str, str]]:
    """(the modules the rewritten code builds as parallel layers, their roles), for the plan.

    Modules: attributes built as parallel layers, fused ones under their checkpoint names, and "experts" when
    routed experts are split over moe_ep_group, "experts_tp" when also over moe_tp_group. Roles: attribute -> the
    role the plan counts it in, for layers built under other names: the vocabulary layers (BLOOM's
    `word_embeddings`, GPT-NeoX-Japanese's `embed_out`), attention's output projection (an OProjParallelLinear,
    or a RowParallelLinear of attn_tp_group) and an MLP's layers named otherwise (BERT's `intermediate.dense` and
    `output.dense`), keyed by the attributes that lead to the layer, as few as tell it from a namesake in another
    role (ModernBERT's `attn.Wo` beside the MLP's whole `Wo`, BERT's `attention.output.dense` beside the MLP's
    `output.dense`); the q / k / v parts of `qkv_proj` (Llama's original `wq` / `wk` / `wv`); and WHOLE for a plain
    linear named like a split layer elsewhere (MiniMax-M3's `indexer.q_proj` beside attention's). COLUMN_QKV
    among the modules when q / k / v are ColumnParallelLinear split by whole heads."""
    kinds = {
        "VocabParallelEmbedding": "embed_tokens",
        "ParallelLMHead": "lm_head",
        "OProjParallelLinear": "o_proj",
    }
    qkv = zip(fused.get("qkv_proj", ()), ("q_proj", "k_proj", "v_proj"), strict=False)
    roles = {part: role for part, role in qkv if part != role}
    attrs, owned = set(), []
    parsed = [(tree, _attribute_paths(tree)) for tree in map(ast.parse, new_code.values())]
    for tree, path in parsed:
        # in-file subclasses of a layer whose role its class tells (Dory's LM head, PR004) -> that class
        based = {
            n.name: n.bases[0].id
            for n in ast.walk(tree)
            if isinstance(n, ast.ClassDef)
            and len(n.bases) == 1
            and isinstance(n.bases[0], ast.Name)
            and n.bases[0].id in kinds
        }
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for attr, call in _self_calls(cls, _PARALLEL | set(based)).items():
                group = next((k.value for k in call.keywords if k.arg == "tp_group"), None)
                group = group.value if isinstance(group, ast.Constant) else None
                ctor = based.get(call.func.id, call.func.id)
                role = kinds.get(ctor) or _linear_role(ctor, group, attr)
                if role in ("o_proj", "lm_head", *_MLP_ROLES.values()) and cls.name in path:
                    owned += [((*p, attr), role) for p in path[cls.name]]
                    continue
                attrs.add(attr)
                in_attention = group == "attn_tp_group"
                if in_attention and ctor == "ColumnParallelLinear" and attr in (*QKV, *FUSED_ON_DISK):
                    attrs.add(COLUMN_QKV)
                if role:
                    roles[attr] = role
    split = {part for a in attrs for part in fused.get(a, (a,))}
    for tree, path in parsed:
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name in path):
            plain = split & set(_self_calls(cls, {"Linear"}, qualified=True))
            owned += [((*p, attr), WHOLE) for attr in plain for p in path[cls.name]]
    roles |= _distinct_keys(owned)
    code = "".join(new_code.values())
    experts = {"experts"} if _EXPERTS in code else set()
    experts |= {"experts_tp"} if _EXPERTS_TP in code else set()
    return frozenset({part for a in attrs for part in fused.get(a, (a,))} | experts), roles


_MLP_ROLES = {"ColumnParallelLinear": "up_proj", "RowParallelLinear": "down_proj"}


def _linear_role(ctor: str, group: str | None, attr: str) -> str | None:
    """o_proj for a RowParallelLinear of attn_tp_group; up_proj / down_proj for a column / row layer of
    dense_tp_group whose name does not say so (BERT's `dense`)."""
    if ctor == "RowParallelLinear" and group == "attn_tp_group":
        return "o_proj"
    if group == "dense_tp_group" and attr not in MLP_LAYERS:
        return _MLP_ROLES.get(ctor)
    return None


def _attribute_paths(tree: ast.AST) -> dict[str, list[tuple[str, ...]]]:
    """class -> the attributes leading to a module of it from each outermost class building it as `self.x =
    Class(...)`: `[("attention", "output")]` for BERT's SelfOutput, also `("crossattention", "output")` where a
    branch builds cross-attention."""
    parents: dict[str, list[tuple[str, str]]] = {}
    for owner in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in (n for n in ast.walk(owner) if isinstance(n, ast.Assign)):
            targets = [
                t for t in node.targets if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"
            ]
            for callee in _built_by(node.value):
                parents.setdefault(callee, []).extend((owner.name, t.attr) for t in targets)

    def paths(cls: str, seen: frozenset[str]) -> list[tuple[str, ...]]:
        if cls not in parents or cls in seen:
            return [()]
        return [(*up, attr) for owner, attr in parents[cls] for up in paths(owner, seen | {cls})]

    return {cls: paths(cls, frozenset()) for cls in parents}


def _built_by(value: ast.expr) -> list[str]:
    """The classes a `self.x = value` builds: `Class(...)`, either branch of `A(...) if c else B(...)`."""
    if isinstance(value, ast.IfExp):
        return _built_by(value.body) + _built_by(value.orelse)
    return [value.func.id] if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) else []


def _distinct_keys(owned: list[tuple[tuple[str, ...], str]]) -> dict[str, str]:
    """`owner.attr` -> role for each (attribute path, role), with more of the path where a namesake in another
    role ends the same way. A path no tail tells apart keeps its whole self: the plan matches the longest key a
    parameter's path ends with (plan._module), so a longer namesake's key still wins for its own parameters."""
    keys = {}
    for path, role in owned:
        for k in range(min(2, len(path)), len(path) + 1):
            tail = path[-k:]
            if all(r == role or other[-k:] != tail for other, r in owned):
                break
        keys[".".join(tail)] = role
    return keys


def replicates_attention(model_dir: Path) -> bool:
    """Whether the directory's rewritten code runs some attention whole on every rank (--replicate-attention)."""
    return any(
        "ReplicatedRegion(" in p.read_text(encoding="utf-8") for p in (model_dir / "models").glob("*.py")
    )


def check_token_layout(pc: ParallelConfig, sources: dict[str, str]) -> None:
    """Refuse attention DP beside TP modules, which splits each step's tokens across ranks between layers along the
    token axis of [batch, tokens, hidden] states, for a model that needs the whole step in a layer (state kept per
    request) or keeps its states [tokens, batch, hidden] (ChatGLM's: its entry picks the last positions along the
    first axis)."""
    if not needs_sharded_layout(pc):
        return
    fix = "Use TP alone (attn_tp_size = world_size), or attention DP with every TP size 1."
    split = f"parallel_config has attention DP {pc.attn_dp_size} beside TP modules, which splits each step's tokens"
    if any("@per_request(" in text for text in sources.values()):
        raise ConfigError(
            f"{split} across ranks between layers; this model's layers that keep state per request (`@per_request`) "
            f"run on the whole step. {fix}"
        )
    if any(f"[{LAST_POSITIONS_SEQ_FIRST}]" in text for text in sources.values()):
        raise ConfigError(
            f"{split} across ranks along the token dimension of [batch, tokens, hidden] states; this model keeps its "
            f"states [tokens, batch, hidden] (its entry picks `[last_token_indices, 0]`). {fix}"
        )


def _load(
    model_dir: Path, config_path: Path, disabled: Collection[str] = (), replicate_attention: bool = False
) -> _Target:
    """Config validated against the model's shapes first (ConfigError, exit 2), then the rewrite made in memory
    and planned from what it actually shards."""
    model_dir = model_dir.resolve()
    pc = load_parallel_config(config_path)
    yaml_path = base_yaml(model_dir)
    config = InferenceConfig.from_yaml(yaml_path)
    model_cls, hf_config = ModelWorker(config, None, model_dir).model_class_and_config()
    sized = with_standard_sizes(hf_config, model_cls, config)  # the config the plan reads
    validate(pc, sized)
    sources = _migrated_sources(model_dir)
    check_token_layout(pc, sources)
    check_rule_ids(disabled, PARALLEL_RULES)
    code = rewrite_sources(sources, model_cls.__name__, disabled, hf_config, replicate_attention)
    if code.findings:
        raise UserError(
            f"skill parallelize cannot shard this model safely: {'; '.join(map(str, code.findings))}. Nothing "
            "was written; port these modules to the parallel layers by hand (see references/model_contract.md)."
        )
    sharded, roles = _layers(code.files, code.fused)
    plan = make_plan(
        pc,
        sized,
        config.model_config.torch_dtype,
        sharded,
        roles,
        _unloaded(code.files),
        code.head_groups,
        code.replicated,
    )
    return _Target(
        model_dir,
        pc,
        yaml_path,
        config,
        model_cls,
        hf_config,
        plan,
        sources,
        code.files,
        code.rewrites,
        code.rules,
    )


def scenario_yaml_name(t: _Target, scenario: str = "") -> str:
    """config/<this name> for the target's parallel config (seed 002's naming; MoE models name their EP size)."""
    return yaml_name(
        t.config.model_name, t.pc, moe=any("MoE" in r for r in t.plan.rewrites), scenario=scenario
    )


def _scenario(t: _Target) -> tuple[str, str, InferenceConfig]:
    """(file name, text, config) of the YAML `skill parallelize` writes for the target's parallel config."""
    name = scenario_yaml_name(t)
    text = scenario_yaml(t.yaml_path.read_text(encoding="utf-8"), t.pc, f"config/{name}")
    return name, text, InferenceConfig.from_dict(yaml.safe_load(text), source=name)


def plan_for_model_dir(
    model_dir: Path, config_path: Path, disabled: Collection[str] = (), replicate_attention: bool = False
) -> Plan:
    t = _load(model_dir, config_path, disabled, replicate_attention)
    return _measured_plan(t, _scenario(t)[2])


def parallelize(
    model_dir: Path,
    config_path: Path,
    mode: str | None = None,
    force: bool = False,
    log: Callable[[str], None] = lambda msg: None,
    disabled: Collection[str] = (),
    replicate_attention: bool = False,
) -> ParallelizeResult:
    t = _load(model_dir, config_path, disabled, replicate_attention)
    model_dir, pc, plan = t.model_dir, t.pc, t.plan
    found = directory_mode(model_dir)
    if mode is not None and mode != found:
        raise UserError(
            f"{model_dir} was migrated in {found} mode, not {mode}; re-run `skill migrate --mode {mode} "
            "--force` first, or drop --mode."
        )
    log(
        f"config valid for {t.hf_config.model_type}: world_size {pc.world_size}, "
        f"{plan.per_rank_param_bytes / 2**20:.1f} MiB of parameters per rank"
    )

    sources, new_code, code_rewrites = t.sources, t.new_code, t.code_rewrites
    scenario_name, scenario_text, scenario_config = _scenario(t)
    plan = _measured_plan(t, scenario_config)  # refuses a rewrite that does not hold the plan's bytes

    as_migrated = _as_migrated(sources, t.model_cls.__name__)
    for name, text in new_code.items():
        _refuse_overwrite(model_dir / "models" / name, text, (sources[name], as_migrated[name]), force)
    target_yaml = model_dir / "config" / scenario_name
    _refuse_overwrite(target_yaml, scenario_text, (), force)

    written = []
    if not (model_dir / PRISTINE).is_dir():  # copied whole, then renamed: never a partial source
        (model_dir / PRISTINE).parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".migrated_models.", dir=(model_dir / PRISTINE).parent))
        shutil.copytree(
            model_dir / "models", staging, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True
        )
        staging.chmod(0o777 & ~UMASK)
        staging.rename(model_dir / PRISTINE)
        written.append(str(PRISTINE))
    for name, text in new_code.items():
        path = model_dir / "models" / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            write_text_atomic(path, text)
            written.append(f"models/{name}")
    write_text_atomic(target_yaml, scenario_text)
    written.append(f"config/{scenario_name}")
    infer_sh = model_dir / "infer.sh"
    if infer_sh.is_file():
        text = infer_sh.read_text(encoding="utf-8")
        updated = _INFER_SH_YAML.sub(f'YAML="${{YAML:-$DIR/config/{scenario_name}}}"', text, count=1)
        if updated != text:
            write_text_atomic(infer_sh, updated)
            written.append("infer.sh")
    resolve_model.cache_clear()
    return ParallelizeResult(
        str(model_dir),
        str(target_yaml),
        pc.world_size,
        [dataclasses.asdict(g) for g in plan.groups],
        [*plan.rewrites, *code_rewrites],
        plan.per_rank_param_bytes,
        plan.total_param_bytes,
        plan.kv_bytes_per_token,
        written,
        t.rules,
    )
