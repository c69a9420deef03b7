"""What a parallel_config implies for a model (seed 002): validation, comm groups, layer rewrites, bytes per rank.

`validate` runs the seed's "配置校验" asserts against the model's real shapes, plus the limits of the runtime's
parallel layers. `make_plan` turns the seed's "配置参数 → 实施步骤速查" table into the groups and rewrites that
`skill parallelize` performs for this model. Every linear / embedding layer gets its parallel class whatever its TP
size (the seed's rule), so the vocab is padded to a multiple of 64 * tp even at TP 1, as VocabParallelEmbedding
does. Routed experts are split over moe_ep_group (expert parallelism, each rank its block of experts) and, where
the experts module's shapes allow, their intermediate size over moe_tp_group. Multi-head latent attention keeps
its low-rank projections whole and splits by heads those whose outputs count heads (q_b_proj, kv_b_proj).
"""

from __future__ import annotations

import dataclasses
import math
import re
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch
from rich.table import Table
from rich.text import Text
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, PretrainedConfig

from runtime.config import ParallelConfig
from runtime.config.comm_manager import group_layout
from runtime.errors import ConfigError, UserError
from runtime.layers.token_layout import needs_sharded_layout
from skills.parallel_impl.rules.attention import FUSED_ON_DISK, OUT

# in `sharded`: q / k / v built as ColumnParallelLinear split by whole heads, not QKVParallelLinear (a layer each
# when k / v are built only in some layers, Gemma 3n's; one when fused on disk per head, GPT-NeoX's)
COLUMN_QKV = "qkv_by_heads"

# the role of parameters every rank holds whole, whatever their names say
WHOLE = "whole"
VOCAB_PAD = 64  # VocabParallelEmbedding's pad_to
_WORLD_SPLITS = (
    "attn_tp_size",
    "dense_tp_size",
    "moe_tp_size",
    "embed_tp_size",
    "lmhead_tp_size",
    "o_proj_tp_size",
    "shared_tp_size",
    "cp_size",
)
# MLP projections the mlp rule shards over dense_tp_group: column (output split) then row (input split)
_MLP_COLUMN = ("gate_proj", "up_proj", "fc1", "c_fc", "dense_h_to_4h", "gate_up_proj")
_MLP_ROW = ("down_proj", "fc2", "c_proj", "dense_4h_to_h")
MLP_LAYERS = (*_MLP_COLUMN, *_MLP_ROW)
_SHARED_MLP = {f"shared_{layer}" for layer in MLP_LAYERS}
_ROW = ("o_proj", *_MLP_ROW, *(f"shared_{layer}" for layer in _MLP_ROW))  # input split: the bias stays whole


@dataclass(frozen=True)
class GroupSpec:
    """Arguments of CommManager.register_group: group_num groups of group_size ranks, interleaved by stride."""

    name: str
    group_num: int
    group_size: int
    stride: int = 1

    def ranks(self) -> list[tuple[int, ...]]:
        return group_layout(self.group_num * self.group_size, self.group_num, self.group_size, self.stride)


@dataclass(frozen=True)
class Plan:
    world_size: int
    groups: list[GroupSpec]
    rewrites: list[str]
    per_rank_param_bytes: int  # identical on every rank: all splits are even
    total_param_bytes: int  # the unsharded model, tied weights once
    # KV cache a token takes on a rank, all layers: measured on the rewritten model (0 until then)
    kv_bytes_per_token: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class _Shapes:
    model_type: str
    hidden: int
    heads: int
    kv_heads: int
    intermediate: tuple[int, ...]  # the dense MLP's widths: several when they differ per layer (Gemma 3n)
    vocab: int
    experts: int  # routed experts; 0 for a dense model
    moe_intermediate: int
    shared_intermediate: int  # the shared experts' FFN width; 0 without them
    mla: bool  # multi-head latent attention (kv_lora_rank)
    tied: bool
    head_groups: int = 1  # runs of heads a rank holds its share of each of (QKVParallelLinear's head_groups)

    def kv_heads_held(self, tp: int) -> int:
        """Key heads a rank of a tp-way attention group holds: its share of each run, or one replicated."""
        n = self.head_groups
        return n * max(self.kv_heads // n // tp, 1)


def _shapes(hf_config: PretrainedConfig) -> _Shapes:
    cfg = hf_config.get_text_config()
    experts = next(
        (n for k in ("num_experts", "n_routed_experts", "num_local_experts") if (n := getattr(cfg, k, None))),
        0,
    ) or _stacked_experts(hf_config)
    widths = getattr(cfg, "intermediate_size", None) or _mlp_width(hf_config)
    intermediate = tuple(sorted(set(widths))) if isinstance(widths, (list, tuple)) else (widths,)
    moe_i = getattr(cfg, "moe_intermediate_size", None) or intermediate[0]
    shared = (
        getattr(cfg, "shared_expert_intermediate_size", None)
        or (getattr(cfg, "n_shared_experts", None) or 0) * moe_i
    )
    return _Shapes(
        cfg.model_type,
        cfg.hidden_size,
        cfg.num_attention_heads,
        _kv_heads(hf_config),
        intermediate,
        cfg.vocab_size,
        experts,
        moe_i,
        shared if experts else 0,
        bool(getattr(cfg, "kv_lora_rank", None)),
        bool(getattr(hf_config, "tie_word_embeddings", False)),
    )


def _kv_heads(hf_config: PretrainedConfig) -> int:
    """Key heads, read off the attention's key weights where the head size is one number: `k_proj`'s (`key`'s) rows, or
    the key block of a q/k/v projection fused on disk (`[q; k; v]`, either way round: Conv1D stores it `[in,
    out]`). A multi-query config such as GPT-BigCode's says `multi_query`; its `num_key_value_heads` follows
    that flag unless a config sets it too. Else the config's count, else one per query head."""
    cfg = hf_config.get_text_config()
    heads, hidden = cfg.num_attention_heads, cfg.hidden_size
    try:
        head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    except RuntimeError:  # a size per layer (Gemma 4): the config's count
        head_dim = None
    for name, shape in _param_shapes(hf_config).items() if head_dim else ():
        if not name.endswith(".weight") or len(shape) != 2:
            continue
        if _attr(name) in ("k_proj", "key"):  # BERT's and its kin's `key`
            return shape[0] // head_dim
        if _attr(name) in FUSED_ON_DISK:
            rows = shape[0] if shape[1] == hidden else shape[1]
            return (rows // head_dim - heads) // 2
    return getattr(cfg, "num_key_value_heads", None) or heads


def _widths(widths: tuple[int, ...]) -> str:
    return " / ".join(map(str, widths))


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _padded(vocab: int, tp: int) -> int:
    multiple = VOCAB_PAD * tp
    return -(-vocab // multiple) * multiple


def validate(pc: ParallelConfig, hf_config: PretrainedConfig, head_groups: int = 1) -> None:
    """Raises one ConfigError naming every size the model's shapes reject, each with the values that would work;
    head_groups: the runs of heads attention TP splits each of."""
    w = pc.world_size
    for key in _WORLD_SPLITS:
        if w % getattr(pc, key):
            raise ConfigError(
                f"parallel_config.{key} is {getattr(pc, key)}, which does not divide world_size {w}; "
                f"use a divisor of {w}: {', '.join(map(str, _divisors(w)))}."
            )
    if pc.cp_size != 1:
        raise ConfigError(
            f"parallel_config.cp_size is {pc.cp_size}, but skill parallelize does not plan context "
            "parallelism; set cp_size to 1."
        )
    s, a, e, lm = _shapes(hf_config), pc.attn_tp_size, pc.embed_tp_size, pc.lmhead_tp_size
    rules: dict[str, list[tuple[Callable[[int], bool], str]]] = {}

    def need(key: str, ok: Callable[[int], bool], why: str) -> None:
        rules.setdefault(key, []).append((ok, why))

    n, heads, kv = head_groups, s.heads // head_groups, s.kv_heads // head_groups  # per run of heads
    runs = f" (in each of {n} runs of heads: {{}})" if n > 1 else ""
    need(
        "attn_tp_size",
        lambda t: heads % t == 0,
        f"num_attention_heads {s.heads}{runs.format(heads)} is not divisible by it",
    )
    need(
        "attn_tp_size",
        lambda t: kv % t == 0 or t % kv == 0,
        f"num_key_value_heads {s.kv_heads}{runs.format(kv)} neither is divisible by it nor divides it (kv heads "
        f"are split over the attn_tp ranks, or replicated when attn_tp_size is a multiple of {kv})",
    )
    if not s.mla:
        need(
            "o_proj_tp_size",
            lambda t: t in (1, a),
            f"{s.model_type} has no multi-head latent attention (kv_lora_rank), so o_proj runs in attn_tp_group "
            f"with attn_tp_size {a}; a separate o_proj TP size applies to MLA models only",
        )
    else:
        need(
            "o_proj_tp_size",
            lambda t: t in (1, a) or t % a == 0,
            f"an o_proj TP size other than attn_tp_size ({a}) must be a multiple of it (its group gathers the "
            "attention outputs of whole attention TP groups, across attention DP ranks)",
        )
        need(
            "o_proj_tp_size",
            lambda t: s.heads % t == 0,
            f"num_attention_heads {s.heads} is not divisible by it",
        )
    need(
        "dense_tp_size",
        lambda t: all(i % t == 0 for i in s.intermediate),
        f"intermediate_size {_widths(s.intermediate)} is not divisible by it",
    )
    if s.experts:
        need(
            "moe_tp_size",
            lambda t: s.experts % (w // t) == 0,
            f"moe_ep_size = world_size {w} / moe_tp_size {pc.moe_tp_size} = {pc.moe_ep_size} does not divide "
            f"num_experts {s.experts}",
        )
        need(
            "moe_tp_size",
            lambda t: s.moe_intermediate % t == 0,
            f"moe_intermediate_size {s.moe_intermediate} is not divisible by it",
        )
    if s.shared_intermediate:
        need(
            "dense_tp_size",
            lambda t: s.shared_intermediate % t == 0,
            f"the shared experts' intermediate size {s.shared_intermediate} (sharded like the dense MLP) is not "
            "divisible by it",
        )
    need(
        "shared_tp_size",
        lambda t: t in (1, pc.dense_tp_size),
        f"the shared experts are sharded with the dense MLP (dense_tp_size {pc.dense_tp_size}); a separate "
        "shared_tp_size is not implemented",
    )
    need(
        "embed_tp_size",
        lambda t: t % a == 0,
        f"it must be a multiple of attn_tp_size {a} (embed_tp_size >= attn_tp_size and embed_tp_size % attn_tp_size "
        "== 0: the embedding's output feeds attention)",
    )

    problems = []
    for key, checks in rules.items():
        value = getattr(pc, key)
        failed = [why for ok, why in checks if not ok(value)]
        if failed:
            valid = [str(t) for t in _divisors(w) if all(ok(t) for ok, _ in checks)]
            problems.append(
                f"parallel_config.{key} is {value}, but {'; and '.join(failed)}; valid {key} values for "
                f"world_size {w}: {', '.join(valid) or 'none, change world_size'}."
            )
    if s.experts and pc.moe_ep_size > 1 and pc.attn_dp_size > 1 and not needs_sharded_layout(pc):
        problems.append(
            f"parallel_config splits {s.experts} experts over moe_ep_size {pc.moe_ep_size} ranks with attention DP "
            f"{pc.attn_dp_size} and every TP size 1: such DP ranks step on their own, but each MoE layer needs "
            "every rank of moe_ep_group in every step; set attn_tp_size, dense_tp_size or embed_tp_size > 1 (the "
            f"TP+DP pattern steps all ranks together), or moe_tp_size {w} to keep the experts whole on every rank."
        )
    if s.tied and e != lm:
        fixes = [f"lmhead_tp_size {e}"] + ([f"embed_tp_size {lm}"] if lm % a == 0 else [])
        problems.append(
            f"parallel_config.lmhead_tp_size is {lm} but embed_tp_size is {e}, and {s.model_type} ties "
            "lm_head to embed_tokens (tie_word_embeddings): the shared weight has one vocab layout; set "
            f"{' or '.join(fixes)}, or untie the weights."
        )
    if problems:
        raise ConfigError(" ".join(problems))


def _mlp_width(hf_config: PretrainedConfig) -> int:
    """The dense MLP's width, for a config that does not name it (BLOOM's 4 x hidden): the output size of its
    first column layer; 0 without one."""
    column = _MLP_COLUMN[:-1]  # gate_up_proj holds two widths
    shapes = _param_shapes(hf_config).items()
    return next((shape[0] for name, shape in shapes if _attr(name) in column and name.endswith(".weight")), 0)


def _stacked_experts(hf_config: PretrainedConfig) -> int:
    """The routed experts of a config that names their count otherwise (Aria's `moe_num_experts`): the leading
    size of the experts' stacked [num_experts, ...] parameters; 0 without them. The model is built only for a
    config with a field about experts."""
    fields = hf_config.get_text_config().to_dict()
    if not any("expert" in k and isinstance(v, int) and v > 1 for k, v in fields.items()):
        return 0
    shapes = _param_shapes(hf_config).items()
    return next((shape[0] for name, shape in shapes if "experts" in name.split(".") and len(shape) == 3), 0)


# id of a config -> (a weak reference to it, its parameter shapes); configs compare by value, so are unhashable
_SHAPES: dict[int, tuple[weakref.ref, dict[str, tuple[int, ...]]]] = {}


def _param_shapes(hf_config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the Hugging Face model (tied ones once), built on the meta device: shapes, no memory.
    Built once per config object (DeepSeek-V3's takes 1.6 s on two cores), however many sizes a plan reads."""
    ref, shapes = _SHAPES.get(id(hf_config), (None, None))
    if ref is None or ref() is not hf_config:
        shapes = _built_shapes(hf_config)
        key = id(hf_config)
        _SHAPES[key] = (weakref.ref(hf_config, lambda _: _SHAPES.pop(key, None)), shapes)
    return shapes


def _built_shapes(hf_config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    # a type transformers does not know is remote code, which ModelWorker loaded only as the YAML trusts it; a known
    # type is built as transformers' own, whatever `auto_map` a checkpoint still carries
    remote = bool(getattr(hf_config, "auto_map", None)) and hf_config.model_type not in CONFIG_MAPPING
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=remote)
    except ValueError as e:
        raise UserError(
            f"transformers cannot build a causal LM for model_type {hf_config.model_type!r} ({e}); "
            "skill parallelize counts parameters from a model type transformers knows."
        ) from e
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _attr(name: str) -> str:
    """The attribute holding a parameter, as the model code names it (`dense` of `attention.dense.weight`)."""
    parts = name.split(".")
    return parts[-2] if len(parts) > 1 else parts[0]


def _module(name: str, roles: Mapping[str, str]) -> str:
    """The module a parameter belongs to, as the rewrites name it ("experts" for every routed expert; roles: an
    attribute's role when its name does not say it, BLOOM's `word_embeddings` the embed_tokens)."""
    parts = name.split(".")
    if "experts" in parts:
        return "experts"
    leaf = _attr(name)
    # `attn.Wo`, `attention.output.dense`: a role the layer has where it is built, the longest path naming it
    owned = next((k for i in range(len(parts) - 1) if (k := ".".join(parts[i:-1])) in roles), None)
    if owned:
        return roles[owned]
    in_attention = len(parts) > 2 and "att" in parts[-3]
    if leaf in OUT and in_attention:  # GPT-NeoX's `attention.dense`
        return "o_proj"
    if leaf in _MLP_COLUMN and in_attention:  # AFMoE's output gate: split by heads with q_proj, not the MLP
        return f"attention_{leaf}"
    return (
        f"shared_{leaf}" if leaf in MLP_LAYERS and any(p.startswith("shared_expert") for p in parts) else leaf
    )


def _own_oproj(pc: ParallelConfig) -> bool:
    """o_proj in oproj_tp_group of its own (MLA with attention DP), not with attention in attn_tp_group."""
    return pc.o_proj_tp_size not in (1, pc.attn_tp_size)


def _tp_sizes(pc: ParallelConfig) -> dict[str, int]:
    a, d = pc.attn_tp_size, pc.dense_tp_size
    return {
        **dict.fromkeys(FUSED_ON_DISK, a),
        "q_proj": a,
        "k_proj": a,
        "v_proj": a,
        "o_proj": pc.o_proj_tp_size if _own_oproj(pc) else a,
        **dict.fromkeys(MLP_LAYERS, d),
        **dict.fromkeys((f"shared_{layer}" for layer in MLP_LAYERS), d),  # a shared expert's, gate_up too
        "embed_tokens": pc.embed_tp_size,
        "lm_head": pc.lmhead_tp_size,
    }


def _held(
    name: str,
    shape: tuple[int, ...],
    pc: ParallelConfig,
    s: _Shapes,
    tp: dict[str, int],
    sharded: frozenset[str],
    roles: Mapping[str, str],
) -> int:
    """Elements of parameter `name` one rank holds after the rewrites; modules not rewritten are replicated."""
    numel, module = math.prod(shape), _module(name, roles)
    if module == WHOLE:
        return numel
    if module == "experts":  # stacked [num_experts, ...]: each rank of moe_ep_group its block
        if "experts" not in sharded or shape[0] != s.experts:
            return numel
        once = len(shape) == 2 and shape[1] == s.hidden  # a bias added after the intermediate sum
        tp = pc.moe_tp_size if "experts_tp" in sharded and not once else 1
        return numel // pc.moe_ep_size // tp
    if (
        leaf := name.rsplit(".", 1)[-1]
    ) in sharded and leaf not in SHARDABLE:  # per-head (sinks): query heads
        return numel // pc.attn_tp_size
    # a shared expert's MLP layers follow the MLP's; a module named so that holds its own parameters (Inkling's
    # stacked `shared_experts`) is no layer the rules split
    own = module.removeprefix("shared_") if module in _SHARED_MLP else module
    if own not in sharded and _attr(name) not in sharded:
        return numel
    # the only other layers the rules build are attention projections sized by heads (MLA's q_b_proj, kv_b_proj)
    size = tp.get(module, pc.attn_tp_size)
    if module in ("embed_tokens", "lm_head"):
        if leaf not in ("weight", "bias"):  # a head's own parameters (Dory's logit scale)
            return numel
        return _padded(shape[0], size) // size * math.prod(shape[1:])
    if module in ("k_proj", "v_proj"):  # split, or one replicated head
        return numel // s.kv_heads * s.kv_heads_held(size)
    if module in FUSED_ON_DISK:  # [q; k; v] rows: q heads split, kv heads as above
        return numel // (s.heads + 2 * s.kv_heads) * (s.heads // size + 2 * s.kv_heads_held(size))
    return numel if module in _ROW and name.endswith("bias") else numel // size


def _rewrites(
    pc: ParallelConfig,
    s: _Shapes,
    modules: set[str],
    sharded: frozenset[str],
    names: Mapping[str, set[str]],
    replicated: Sequence[str] = (),
) -> tuple[list[str], dict[str, int]]:
    """The steps, in the seed's order, and the size of each comm group they use; names: module -> the
    attributes the model code holds it in (GPT-2's o_proj is `c_proj`); replicated: attention classes run whole."""
    w, a, tp = pc.world_size, pc.attn_tp_size, _tp_sizes(pc)
    e, lm, d = tp["embed_tokens"], tp["lm_head"], tp["down_proj"]
    steps: list[str] = []
    groups: dict[str, int] = {}

    def on(group: str, size: int) -> str:
        if size == 1:
            return " (unsharded, no group)"
        groups[group] = size
        return f" on {group}"

    if not replicated or sharded & {"q_proj", "k_proj", "v_proj", "o_proj", *FUSED_ON_DISK}:
        steps += _attention_steps(pc, s, modules, sharded, names, on)
    if replicated:
        steps.append(
            f"{', '.join(replicated)} run whole on every rank (ReplicatedRegion: weights and KV cache unsplit; the "
            f"tokens of a DP rank gathered in){on('attn_tp_group', a)}"
        )
    whole = sorted((modules & {*MLP_LAYERS, "embed_tokens", "lm_head"}) - sharded)
    if whole:
        steps.append(
            f"{'/'.join(whole)} stay replicated: the migrated code does not build them as plain "
            "nn.Linear / nn.Embedding layers the rules shard"
        )
    modules = modules - set(whole)
    dense = bool(modules & set(MLP_LAYERS))
    if dense:
        i = s.intermediate
        column = [m for m in _MLP_COLUMN if m in modules]
        kind = "MergedColumnParallelLinear" if len(column) > 1 else "ColumnParallelLinear"
        per_rank = _widths(tuple(w // d for w in i))
        steps.append(
            f"{'/'.join(column)} -> {kind} (dense_tp={d}: intermediate {_widths(i)} -> {per_rank} per rank)"
            f"{on('dense_tp_group', d)}"
        )
        steps.append(
            f"{'/'.join(m for m in _MLP_ROW if m in modules)} -> RowParallelLinear (dense_tp={d})"
            f"{on('dense_tp_group', d)}"
        )
    if s.shared_intermediate and "shared_down_proj" in modules:
        i = s.shared_intermediate
        steps.append(
            f"shared expert gate_proj/up_proj -> MergedColumnParallelLinear, down_proj -> "
            f"RowParallelLinear (with the dense MLP, dense_tp={d}: intermediate {i} -> {i // d} per rank)"
            f"{on('dense_tp_group', d)}"
        )
    expert_tp = pc.moe_tp_size if "experts_tp" in sharded else 1
    if "experts" in sharded and max(pc.moe_ep_size, expert_tp) > 1:
        ep, per = pc.moe_ep_size, s.experts // pc.moe_ep_size
        owners = "; ".join(
            f"experts {i * per}-{(i + 1) * per - 1} on ranks {[r for r in range(w) if r // pc.moe_tp_size == i]}"
            for i in range(ep)
        )
        steps.append(
            f"MoE experts -> ExpertParallel (moe_ep={ep}: {per} of {s.experts} experts per rank; {owners}): "
            f"tokens dispatched to their experts' owners (parallel_config.moe_dispatch {pc.moe_dispatch}) "
            f"when ranks hold their own tokens, else partial sums all_reduced{on('moe_ep_group', ep)}; "
            "router replicated"
            if ep > 1
            else f"MoE experts -> ExpertParallel: all {s.experts} experts on every rank (moe_ep=1), router replicated"
        )
        i = s.moe_intermediate
        if expert_tp > 1:
            steps.append(
                f"expert TP (moe_tp={expert_tp}): each expert's intermediate {i} -> {i // expert_tp} per rank, "
                f"partial sums reduced once after the combine{on('moe_tp_group', expert_tp)}"
            )
        elif pc.moe_tp_size > 1:
            steps.append(
                f"moe_tp_size {pc.moe_tp_size} is validated but not applied: the experts module's shapes do not "
                "say which dimension is the intermediate one (or forward reads its whole size), so each expert "
                "stays whole on the ranks of its moe_tp group"
            )
    elif "experts" in modules:
        why = (
            "the migrated code holds no experts module the rules split"
            if "experts" not in sharded
            else f"moe_ep_size is 1 and moe_tp_size {pc.moe_tp_size} is not applied to them"
        )
        steps.append(f"MoE experts: all {s.experts} whole on every rank, router replicated: {why}")
    if "embed_tokens" in modules:
        p = _padded(s.vocab, e)
        steps.append(
            f"embed_tokens -> VocabParallelEmbedding (embed_tp={e}: vocab {s.vocab} padded to {p}, "
            f"{p // e} rows per rank){on('embed_tp_group', e)}"
        )
    if s.tied and "lm_head" in sharded:
        steps.append(
            f"lm_head -> ParallelLMHead tied to embed_tokens: shares its vocab shards (tie_weights)"
            f"{on('lmhead_tp_group', lm)}"
        )
    elif "lm_head" in modules:
        p = _padded(s.vocab, lm)
        steps.append(
            f"lm_head -> ParallelLMHead (lmhead_tp={lm}: vocab {s.vocab} padded to {p}, {p // lm} rows "
            f"per rank){on('lmhead_tp_group', lm)}"
        )
    if a > 1 and pc.attn_dp_size > 1:
        whole = "; replicated attention keeps the rank's rows of its output instead" if replicated else ""
        steps.append(
            f"attention TP+DP (attn_tp={a}, attn_dp={pc.attn_dp_size}): hidden kept as [T/{a}, H] between "
            "layers, all_gather before QKV and reduce_scatter after o_proj on attn_tp_group (not all_reduce)"
            f"{whole}; tokens padded to a multiple of {a}; prefill all_gathers hidden before picking last tokens"
        )
    elif a == 1 and w > 1:
        lockstep = (
            " that step together: the other TP groups span them, so each rank holds its tokens padded to "
            "the longest rank's"
            if max(e, lm, d if dense else 1, tp["o_proj"]) > 1
            else ""
        )
        steps.append(
            f"plain DP: requests split over {w} attention-DP ranks{lockstep}; attention needs no TP group"
        )
    neighbours = [("embed_tokens", e)] + ([("MLP", d)] if dense else []) + [("lm_head", lm)]
    steps += [
        f"re-layout all_gather/reduce_scatter between attention (tp={a}) and {m} (tp={t})"
        for m, t in neighbours
        if t != a
    ]
    return steps, groups


SHARDABLE = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", *MLP_LAYERS, "embed_tokens", "lm_head"})


def _attention_steps(
    pc: ParallelConfig,
    s: _Shapes,
    modules: set[str],
    sharded: frozenset[str],
    names: Mapping[str, set[str]],
    on: Callable[[str, int], str],
) -> list[str]:
    """The attention steps of _rewrites (on: registers a group and says where a step runs)."""
    a = pc.attn_tp_size
    steps: list[str] = []
    h, kv, n = s.heads, s.kv_heads, s.head_groups
    if n > 1:
        kv_note = f"{s.kv_heads_held(a)} of {kv} kv heads, a rank's share of each of {n} runs of heads"
    elif kv % a == 0:
        kv_note = f"{kv // a} of {kv} kv heads"
    else:
        kv_note = f"1 kv head (each of the {kv} replicated on {a // kv} ranks)"
    if s.mla:
        per_head = sorted(sharded - SHARDABLE - {"experts", "experts_tp"})
        steps.append(
            f"{'/'.join(per_head)} -> ColumnParallelLinear by heads (attn_tp={a}: {h // a} of {h} heads per "
            f"rank){on('attn_tp_group', a)}; the low-rank projections of q and of the shared latent stay replicated"
        )
    else:
        fused = sorted(modules & sharded & set(FUSED_ON_DISK))
        by_heads = COLUMN_QKV in sharded
        if fused and by_heads:
            qkv = (
                f"{fused[0]} (q, k and v interleaved per head on disk) -> ColumnParallelLinear by whole heads"
            )
        elif fused:
            qkv = f"{fused[0]} (q, k and v blocks fused on disk) -> QKVParallelLinear"
        else:
            parts = "/".join("/".join(sorted(names.get(p, {p}))) for p in ("q_proj", "k_proj", "v_proj"))
            qkv = f"{parts} -> {'ColumnParallelLinear each' if by_heads else 'QKVParallelLinear'}"
        steps.append(
            f"{qkv} (attn_tp={a}: {h // a} of {h} heads and {kv_note} per rank){on('attn_tp_group', a)}"
        )
    o_name = "/".join(sorted(names.get("o_proj", {"o_proj"})))
    if _own_oproj(pc):
        o = pc.o_proj_tp_size
        steps.append(
            f"{o_name} -> OProjParallelLinear (o_proj_tp={o}: {h // o} of {h} heads' columns per rank; the tokens of "
            f"{o // a} attention-DP ranks gathered in, the partial sums reduce-scattered back)"
            f"{on('oproj_tp_group', o)}"
        )
    else:
        steps.append(f"{o_name} -> RowParallelLinear (attn_tp={a}){on('attn_tp_group', a)}")
    if a > 1:
        formula = f"{n} x max({kv} // {n} // {a}, 1)" if n > 1 else f"max({kv} // {a}, 1)"
        steps.append(
            f"paged KV cache: cache_entries num_head = {formula} = {s.kv_heads_held(a)} kv heads per rank"
        )
    return steps


def make_plan(
    pc: ParallelConfig,
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    sharded: frozenset[str] = SHARDABLE,
    roles: Mapping[str, str] = MappingProxyType({}),
    unloaded: Collection[str] = (),
    head_groups: int = 1,
    replicated: Sequence[str] = (),
) -> Plan:
    """Validates `pc` for the model, then lists the comm groups, the rewrites and the parameter bytes per rank.

    `sharded`: the modules the rewritten code builds as parallel layers (shared-expert MLPs follow the MLP names);
    the others are planned whole on every rank. `roles`: attribute -> embed_tokens / lm_head / o_proj for the
    layers the rewritten code builds under other names; one keyed by its owner (`attn.Wo`) is not in `sharded`
    under its own name, which then means a namesake elsewhere. `unloaded`: patterns (re.search) of the
    parameters the model skips loading and does not build. `head_groups`: the runs of heads the q/k/v layer
    gives each rank its share of each of (DiffLlama's 2). `replicated`: attention classes run whole on every rank
    (`--replicate-attention`)."""
    s = dataclasses.replace(_shapes(hf_config), head_groups=head_groups)
    validate(pc, hf_config, head_groups)
    sharded |= frozenset(roles.values())
    shapes = {n: v for n, v in _param_shapes(hf_config).items() if not any(re.search(p, n) for p in unloaded)}
    roles = {**roles, **_head_holders(roles, shapes)}
    names: dict[str, set[str]] = {}  # module -> the attributes the model code holds it in
    for name in shapes:
        names.setdefault(_module(name, roles), set()).add(_attr(name))
    modules = set(names)
    # projections the rules split by heads under names of their own
    by_heads = modules & (sharded - SHARDABLE - set(roles))
    if not replicated and (
        "o_proj" not in modules
        or not (s.mla or {"q_proj", "k_proj", "v_proj"} <= modules or modules & {*FUSED_ON_DISK} or by_heads)
    ):
        raise UserError(
            f"{s.model_type} has neither q_proj / k_proj / v_proj, a fused qkv projection nor multi-head "
            "latent attention, with o_proj; skill parallelize shards these attention layouts only."
        )
    steps, sizes = _rewrites(pc, s, modules, sharded, names, replicated)
    w = pc.world_size
    ep_stride = {"moe_ep_group": pc.moe_tp_size}  # ranks sharing a moe_tp index
    groups = [GroupSpec(name, w // n, n, ep_stride.get(name, 1)) for name, n in sizes.items()]
    tp = _tp_sizes(pc)
    held = sum(_held(name, shape, pc, s, tp, sharded, roles) for name, shape in shapes.items())
    total = sum(math.prod(shape) for shape in shapes.values())
    return Plan(w, groups, steps, held * dtype.itemsize, total * dtype.itemsize)


def _head_holders(roles: Mapping[str, str], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
    """The module an LM head is built in (`lm_head` of BertGeneration's `lm_head.decoder`) -> the head's role when
    transformers lists the module's bias in place of the head's (tied to it), else WHOLE."""
    holders = {}
    for key, role in roles.items():
        holder, _, head = key.rpartition(".")
        if role == "lm_head" and holder:
            biases = [n for n in shapes if n == f"{holder}.bias" or n.endswith(f".{holder}.bias")]
            tied = bool(biases) and not any(
                f"{n.removesuffix('.bias')}.{head}.bias" in shapes for n in biases
            )
            holders[holder] = role if tied else WHOLE
    return holders


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB ({n:,} bytes)"


def format_plan(plan: Plan) -> Table:
    table = Table("", "", title=f"parallel plan, world_size {plan.world_size}", show_header=False)
    for g in plan.groups:
        ranks = " ".join(str(list(r)) for r in g.ranks())
        table.add_row(f"group {g.name}", f"{g.group_num} x {g.group_size} ranks, stride {g.stride}: {ranks}")
    for i, step in enumerate(plan.rewrites, 1):
        table.add_row(f"rewrite {i}", Text(step))
    table.add_row("params per rank", f"{_mib(plan.per_rank_param_bytes)} of {_mib(plan.total_param_bytes)}")
    if plan.kv_bytes_per_token:
        table.add_row("KV cache per token", f"{plan.kv_bytes_per_token:,} bytes per rank, all layers")
    return table
