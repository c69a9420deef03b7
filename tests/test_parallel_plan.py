"""skills.parallel_impl: parallel_config loading, validation against model shapes, groups, rewrites, bytes per rank."""

import io
import math
import textwrap

import pytest
import torch
from rich.console import Console
from tiny_checkpoint import tiny_config
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from runtime.config import ParallelConfig
from runtime.errors import ConfigError, UserError
from runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from runtime.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from skills.parallel_impl.config import load_parallel_config, yaml_name
from skills.parallel_impl.pipeline import _layers, _unloaded
from skills.parallel_impl.plan import (
    COLUMN_QKV,
    SHARDABLE,
    _module,
    _param_shapes,
    format_plan,
    make_plan,
    validate,
)

BF16 = torch.bfloat16.itemsize


def llama(**kw) -> PretrainedConfig:
    base = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 500,
        "num_hidden_layers": 2,
    }
    return AutoConfig.for_model("llama", **{**base, **kw})


def qwen3(**kw) -> PretrainedConfig:
    return AutoConfig.for_model(
        "qwen3",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=512,
        num_hidden_layers=2,
        **kw,
    )


def qwen3_moe() -> PretrainedConfig:
    return AutoConfig.for_model(
        "qwen3_moe",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=512,
        num_hidden_layers=2,
        num_experts=4,
        moe_intermediate_size=32,
        num_experts_per_tok=2,
    )


def deepseek_v3() -> PretrainedConfig:
    return AutoConfig.for_model(
        "deepseek_v3",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        vocab_size=500,
        num_hidden_layers=2,
        n_routed_experts=4,
        moe_intermediate_size=32,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        first_k_dense_replace=1,
        n_shared_experts=2,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
    )


def pc(world: int, attn: int = 1, dense: int = 1, embed: int = 1, lmhead: int = 1, **kw) -> ParallelConfig:
    return ParallelConfig(
        world_size=world,
        attn_tp_size=attn,
        dense_tp_size=dense,
        embed_tp_size=embed,
        lmhead_tp_size=lmhead,
        **kw,
    )


class _Groups:
    """What the runtime layers ask a CommManager (tp_info), for one rank, without torch.distributed."""

    def __init__(self, p: ParallelConfig, rank: int):
        sizes = {
            "attn_tp_group": p.attn_tp_size,
            "dense_tp_group": p.dense_tp_size,
            "embed_tp_group": p.embed_tp_size,
            "lmhead_tp_group": p.lmhead_tp_size,
        }
        self.sizes, self.rank = {k: v for k, v in sizes.items() if v > 1}, rank

    def has_group(self, name: str) -> bool:
        return name in self.sizes

    def get_size(self, name: str) -> int:
        return self.sizes[name]

    def get_rank(self, name: str) -> int:
        return self.rank % self.sizes[name]

    def get_group(self, name: str) -> None:
        return None


def hand_sharded_bytes(cfg: PretrainedConfig, p: ParallelConfig, rank: int) -> int:
    """Parameter bytes of rank `rank` of a llama / qwen3 built from the runtime's parallel layers (meta device)."""
    cm, h, d = _Groups(p, rank), cfg.hidden_size, cfg.head_dim
    with torch.device("meta"):
        layers: list[nn.Module] = []
        for _ in range(cfg.num_hidden_layers):
            layers += [
                QKVParallelLinear(h, d, cfg.num_attention_heads, cfg.num_key_value_heads, comm_manager=cm),
                RowParallelLinear(cfg.num_attention_heads * d, h, comm_manager=cm, tp_group="attn_tp_group"),
                MergedColumnParallelLinear(h, [cfg.intermediate_size] * 2, comm_manager=cm),
                RowParallelLinear(cfg.intermediate_size, h, comm_manager=cm),
            ]
        embed = VocabParallelEmbedding(cfg.vocab_size, h, comm_manager=cm)
        head = ParallelLMHead(cfg.vocab_size, h, comm_manager=cm)
        if cfg.tie_word_embeddings:
            head.tie_weights(embed)
    params = sum(t.numel() for t in nn.ModuleList([*layers, embed, head]).parameters())
    norms = cfg.num_hidden_layers * (2 * h + (2 * d if cfg.model_type == "qwen3" else 0)) + h
    return (params + norms) * BF16


VALID = [  # (model, config, groups as (name, group_num, group_size, stride), rewrite fragments)
    (
        llama(),
        pc(2, 2, 2, 2, 2),
        [
            ("attn_tp_group", 1, 2, 1),
            ("dense_tp_group", 1, 2, 1),
            ("embed_tp_group", 1, 2, 1),
            ("lmhead_tp_group", 1, 2, 1),
        ],
        [
            "QKVParallelLinear (attn_tp=2: 2 of 4 heads and 1 of 2 kv heads per rank) on attn_tp_group",
            "o_proj -> RowParallelLinear (attn_tp=2) on attn_tp_group",
            "gate_proj/up_proj -> MergedColumnParallelLinear (dense_tp=2: intermediate 128 -> 64 per rank)",
            "down_proj -> RowParallelLinear (dense_tp=2) on dense_tp_group",
            "embed_tokens -> VocabParallelEmbedding (embed_tp=2: vocab 500 padded to 512, 256 rows per rank)",
            "lm_head -> ParallelLMHead (lmhead_tp=2",
        ],
    ),
    (
        llama(),
        pc(4, 4, 4, 4, 4),
        [
            ("attn_tp_group", 1, 4, 1),
            ("dense_tp_group", 1, 4, 1),
            ("embed_tp_group", 1, 4, 1),
            ("lmhead_tp_group", 1, 4, 1),
        ],
        [
            "1 of 4 heads and 1 kv head (each of the 2 replicated on 2 ranks) per rank",
            "cache_entries num_head = max(2 // 4, 1) = 1",
            "vocab 500 padded to 512, 128 rows per rank",
        ],
    ),
    (
        llama(),
        pc(2, 1, 2, 2, 2),
        [("dense_tp_group", 1, 2, 1), ("embed_tp_group", 1, 2, 1), ("lmhead_tp_group", 1, 2, 1)],
        [
            "QKVParallelLinear (attn_tp=1: 4 of 4 heads and 2 of 2 kv heads per rank) (unsharded, no group)",
            "plain DP: requests split over 2 attention-DP ranks",
            "between attention (tp=1) and embed_tokens (tp=2)",
            "between attention (tp=1) and MLP (tp=2)",
        ],
    ),
    (
        llama(),
        pc(4, 2, 4, 4, 4),
        [
            ("attn_tp_group", 2, 2, 1),
            ("dense_tp_group", 1, 4, 1),
            ("embed_tp_group", 1, 4, 1),
            ("lmhead_tp_group", 1, 4, 1),
        ],
        [
            "attention TP+DP (attn_tp=2, attn_dp=2)",
            "tokens padded to a multiple of 2",
            "re-layout all_gather/reduce_scatter between attention (tp=2) and MLP (tp=4)",
            "between attention (tp=2) and lm_head (tp=4)",
        ],
    ),
    (
        qwen3(tie_word_embeddings=True),
        pc(4, 2, 2, 4, 4),
        [
            ("attn_tp_group", 2, 2, 1),
            ("dense_tp_group", 2, 2, 1),
            ("embed_tp_group", 1, 4, 1),
            ("lmhead_tp_group", 1, 4, 1),
        ],
        ["lm_head -> ParallelLMHead tied to embed_tokens: shares its vocab shards"],
    ),
]


@pytest.mark.parametrize("cfg, p, groups, fragments", VALID)
def test_valid_configs_give_groups_rewrites_and_bytes(cfg, p, groups, fragments):
    plan = make_plan(p, cfg, torch.bfloat16)
    assert [(g.name, g.group_num, g.group_size, g.stride) for g in plan.groups] == groups
    text = "\n".join(plan.rewrites)
    for fragment in fragments:
        assert fragment in text
    assert ("attention TP+DP" in text) == (1 < p.attn_tp_size < p.world_size)
    assert ("plain DP" in text) == (p.attn_tp_size == 1 < p.world_size)
    for rank in range(p.world_size):
        assert plan.per_rank_param_bytes == hand_sharded_bytes(cfg, p, rank)
    padding = (512 - cfg.vocab_size) * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    assert plan.total_param_bytes == hand_sharded_bytes(cfg, pc(1), 0) - padding * BF16  # unpadded vocab
    assert plan.to_dict()["groups"][0]["name"] == groups[0][0]
    out = io.StringIO()
    Console(file=out, width=300).print(format_plan(plan))
    assert groups[0][0] in out.getvalue() and "params per rank" in out.getvalue()


def _moe_bytes(experts_per_rank: float) -> int:
    """qwen3_moe() at attn_tp 2, embed_tp 2, lmhead_tp 4 with `experts_per_rank` of its 4 experts per rank."""
    h, d, layers = 64, 16, 2
    attention = (h * 4 * d // 2 + 2 * h * 1 * d) + 4 * d // 2 * h + 2 * d  # qkv, o_proj, q_norm/k_norm
    moe = int(experts_per_rank * 3 * h * 32) + 4 * h  # this rank's experts of gate/up/down, router
    return (layers * (attention + moe + 2 * h) + h + 512 // 2 * h + 512 // 4 * h) * BF16


def test_moe_experts_stay_whole_without_an_experts_module_the_rules_split():
    plan = make_plan(pc(4, 2, 1, 2, 4), qwen3_moe(), torch.bfloat16)
    assert {g.name for g in plan.groups} == {"attn_tp_group", "embed_tp_group", "lmhead_tp_group"}
    text = "\n".join(plan.rewrites)
    assert "MoE experts: all 4 whole on every rank" in text and "no experts module" in text
    assert "gate_proj/up_proj" not in text  # every layer is sparse: no dense MLP, no dense_tp_group
    assert plan.per_rank_param_bytes == _moe_bytes(4)


@pytest.mark.parametrize(
    ("moe_tp", "expert_tp", "ep_ranks", "owners"),
    [
        (
            1,
            False,
            [(0, 1, 2, 3)],
            "experts 0-0 on ranks [0]; experts 1-1 on ranks [1]; experts 2-2 on ranks [2]",
        ),
        (2, False, [(0, 2), (1, 3)], "experts 0-1 on ranks [0, 1]; experts 2-3 on ranks [2, 3]"),
        (2, True, [(0, 2), (1, 3)], "experts 0-1 on ranks [0, 1]; experts 2-3 on ranks [2, 3]"),
    ],
)
def test_moe_experts_split_over_moe_ep_group(moe_tp, expert_tp, ep_ranks, owners):
    sharded = SHARDABLE | {"experts"} | ({"experts_tp"} if expert_tp else set())
    plan = make_plan(pc(4, 2, 1, 2, 4, moe_tp_size=moe_tp), qwen3_moe(), torch.bfloat16, sharded)
    (ep,) = [g for g in plan.groups if g.name == "moe_ep_group"]
    assert ep.ranks() == ep_ranks and ep.stride == moe_tp
    assert ("moe_tp_group" in {g.name for g in plan.groups}) == expert_tp
    text = "\n".join(plan.rewrites)
    assert "MoE experts -> ExpertParallel" in text and owners in text
    assert ("moe_tp_size 2 is validated but not applied" in text) == (moe_tp == 2 and not expert_tp)
    assert ("intermediate 32 -> 16 per rank" in text) == expert_tp
    held = 4 // (4 // moe_tp) / (moe_tp if expert_tp else 1)  # experts' worth of weights each rank holds
    assert plan.per_rank_param_bytes == _moe_bytes(held)


def test_moe_ep_with_plain_attention_dp_is_refused():
    message = rejected(pc(2, 1, 1, 1, 1), qwen3_moe())
    assert "moe_ep_size 2" in message and "step on their own" in message and "moe_tp_size 2" in message


def test_latent_attention_splits_its_per_head_projections_only():
    """DeepSeek-V3 at attention TP 2: q_b_proj, kv_b_proj and o_proj hold half their weights per rank, the low-rank
    projections (q_a_proj, kv_a_proj_with_mqa) and their norms stay whole."""
    sharded = SHARDABLE | {"q_b_proj", "kv_b_proj"}
    tp2 = make_plan(pc(2, 2, 2, 2, 2), deepseek_v3(), torch.bfloat16, sharded)
    tp1 = make_plan(pc(2, 1, 2, 2, 2), deepseek_v3(), torch.bfloat16, sharded)
    h, heads, layers = 64, 4, 2
    per_head = 32 * heads * (16 + 8) + 16 * heads * (16 + 16) + heads * 16 * h  # q_b_proj, kv_b_proj, o_proj
    assert tp1.per_rank_param_bytes - tp2.per_rank_param_bytes == layers * per_head // 2 * BF16
    assert tp2.rewrites[0].startswith(
        "kv_b_proj/q_b_proj -> ColumnParallelLinear by heads (attn_tp=2: 2 of 4"
    )


def test_o_proj_in_its_own_group_needs_latent_attention_and_whole_attention_groups():
    assert "applies to MLA models only" in rejected(pc(2, 1, o_proj_tp_size=2), llama())
    message = rejected(pc(4, 4, 4, 4, 4, o_proj_tp_size=2), deepseek_v3())
    assert (
        "must be a multiple of it" in message
        and "valid o_proj_tp_size values for world_size 4: 1, 4" in message
    )
    validate(pc(4, 1, 4, 4, 4, o_proj_tp_size=4), deepseek_v3())
    # attention TP 2 x DP 2, o_proj over all 4 ranks: each gathers the outputs of 2 attention DP ranks
    both = make_plan(pc(4, 2, 4, 4, 4, o_proj_tp_size=4), deepseek_v3(), torch.bfloat16, SHARDABLE)
    assert any(
        r.startswith("o_proj -> OProjParallelLinear (o_proj_tp=4: 1 of 4 heads") for r in both.rewrites
    )
    assert any("the tokens of 2 attention-DP ranks gathered in" in r for r in both.rewrites)
    plan = make_plan(pc(2, 1, 2, 2, 2, o_proj_tp_size=2), deepseek_v3(), torch.bfloat16, SHARDABLE)
    assert any(g.name == "oproj_tp_group" and g.group_size == 2 for g in plan.groups)
    assert any(
        r.startswith("o_proj -> OProjParallelLinear (o_proj_tp=2: 2 of 4 heads") for r in plan.rewrites
    )


def rejected(p: ParallelConfig, cfg: PretrainedConfig) -> str:
    with pytest.raises(ConfigError) as info:
        validate(p, cfg)
    assert info.value.exit_code == 2
    return str(info.value)


@pytest.mark.parametrize(
    "cfg, p, fragments",
    [
        (
            llama(hidden_size=96, num_attention_heads=6),
            pc(4, 4, 4, 4, 4),
            [
                "parallel_config.attn_tp_size is 4",
                "num_attention_heads 6 is not divisible",
                "valid attn_tp_size values for world_size 4: 1, 2.",
            ],
        ),
        (
            llama(hidden_size=96, num_attention_heads=6, num_key_value_heads=3),
            pc(6, 2, 2, 2, 2),
            [
                "num_key_value_heads 3 neither is divisible by it nor divides it",
                "attn_tp_size values for world_size 6: 1, 3, 6",
            ],
        ),
        (
            llama(),
            pc(4, 4, 4, 2, 4),
            [
                "parallel_config.embed_tp_size is 2",
                "multiple of attn_tp_size 4",
                "embed_tp_size values for world_size 4: 4.",
            ],
        ),
        (
            llama(),
            pc(4, 3),
            [
                "parallel_config.attn_tp_size is 3, which does not divide world_size 4",
                "divisor of 4: 1, 2, 4",
            ],
        ),
        (
            llama(intermediate_size=100),
            pc(8, 1, 8),
            [
                "parallel_config.dense_tp_size is 8",
                "intermediate_size 100",
                "dense_tp_size values for world_size 8: 1, 2, 4.",
            ],
        ),
        (
            llama(tie_word_embeddings=True),
            pc(4, 2, 2, 4, 2),
            [
                "lmhead_tp_size is 2 but embed_tp_size is 4",
                "tie_word_embeddings",
                "set lmhead_tp_size 4 or embed_tp_size 2",
            ],
        ),
        (
            llama(),
            pc(2, 1, o_proj_tp_size=2),
            [
                "parallel_config.o_proj_tp_size is 2",
                "multi-head latent attention",
                "values for world_size 2: 1.",
            ],
        ),
        (
            qwen3_moe(),
            pc(8, 1, 1, 1, 1, moe_tp_size=1),
            [
                "moe_ep_size = world_size 8 / moe_tp_size 1 = 8 does not divide num_experts 4",
                "moe_tp_size values for world_size 8: 2, 4, 8.",
            ],
        ),
        (llama(), pc(2, cp_size=2), ["parallel_config.cp_size is 2"]),
    ],
)
def test_invalid_configs_name_the_parameter_and_alternatives(cfg, p, fragments):
    message = rejected(p, cfg)
    for fragment in fragments:
        assert fragment in message


def write(tmp_path, text: str):
    path = tmp_path / "parallel.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_load_block_or_bare_keys(tmp_path):
    block = load_parallel_config(
        write(
            tmp_path,
            """\
        model_name: llama
        world_size: 4
        parallel_config: {world_size: 4, attn_tp_size: 2, dense_tp_size: 4, embed_tp_size: 4, lmhead_tp_size: 4}
        """,
        )
    )
    bare = load_parallel_config(
        write(
            tmp_path,
            """\
        world_size: 4
        attn_tp_size: 2
        attn_dp_size: 2
        dense_tp_size: 4
        embed_tp_size: 4
        lmhead_tp_size: 4
        """,
        )
    )
    assert block == bare and bare.attn_dp_size == 2 and bare.dense_tp_size == 4


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("world_size: 2\natn_tp_size: 2\n", ["unknown key `atn_tp_size`", "did you mean `attn_tp_size`"]),
        (
            "parallel_config: {world_size: 2, atn_tp_size: 2}\n",
            ["atn_tp_size", "did you mean `attn_tp_size`"],
        ),
        (
            "attn_tp_size: 2\nparallel_config: {world_size: 2}\n",
            ["`attn_tp_size` is at the top level", "not both"],
        ),
        (
            "world_size: 4\nattn_tp_size: 2\nattn_dp_size: 4\n",
            ["`attn_dp_size` is 4", "world_size 4 / attn_tp_size 2; remove it or set it to 2"],
        ),
        (
            "world_size: 4\nparallel_config: {world_size: 2}\n",
            ["`world_size` is 4", "parallel_config.world_size` is 2"],
        ),
        ("attn_tp_size: 2\n", ["world_size is not set"]),
        ("parallel_config: {world_size: '2'}\n", ["`parallel_config.world_size` is '2'", "valid integer"]),
        ("- 1\n", ["expected a mapping"]),
    ],
)
def test_load_rejects(tmp_path, text, fragments):
    with pytest.raises(ConfigError) as info:
        load_parallel_config(write(tmp_path, text))
    for fragment in fragments:
        assert fragment in str(info.value)


def test_yaml_name():
    assert yaml_name("llama", pc(2, 2, 2, 2, 2)) == "llama_rank_2_2tp.yaml"
    assert (
        yaml_name("Llama-3", pc(4, 2, 4, 4, 4)) == "llama_3_rank_4_2tp_2dp_densetp4_embedtp4_lmheadtp4.yaml"
    )
    assert (
        yaml_name("qwen3_moe", pc(4, 4, 4, 4, 4), moe=True, scenario="decode")
        == "qwen3_moe_rank_4_4tp_ep4_decode.yaml"
    )
    assert (
        yaml_name("ds", pc(8, 1, 1, 1, 1, moe_tp_size=2, o_proj_tp_size=8), moe=True)
        == "ds_rank_8_1tp_8dp_oprojtp8_moetp2_ep4.yaml"
    )
    assert (  # a second dispatch mode of the same sizes gets a YAML of its own
        yaml_name("qwen3_moe", pc(4, 2, 4, 4, 4, moe_dispatch="all_gather"), moe=True)
        == "qwen3_moe_rank_4_2tp_2dp_densetp4_embedtp4_lmheadtp4_ep4_allgather.yaml"
    )


def test_vocabulary_layers_under_other_names_follow_their_own_tp_sizes():
    """BLOOM's embedding is `word_embeddings` (its head tied to it): at embed_tp 4 with attention TP 2 each rank
    holds a quarter of it, as VocabParallelEmbedding builds it, not attention's half. Its config names no
    intermediate_size: the MLP's width (4 x hidden) is read off its first column layer."""
    cfg = AutoConfig.for_model("bloom", hidden_size=64, n_head=4, n_layer=2, vocab_size=512)
    assert not hasattr(cfg, "intermediate_size")
    sharded = frozenset({"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h", "word_embeddings"})
    roles = {"word_embeddings": "embed_tokens"}
    named = make_plan(pc(4, 2, 4, 4, 4), cfg, torch.bfloat16, sharded, roles)
    unnamed = make_plan(pc(4, 2, 4, 4, 4), cfg, torch.bfloat16, sharded)
    assert unnamed.per_rank_param_bytes - named.per_rank_param_bytes == 512 * 64 * (1 / 2 - 1 / 4) * BF16
    assert any(r.startswith("embed_tokens -> VocabParallelEmbedding (embed_tp=4") for r in named.rewrites)
    assert any("(dense_tp=4: intermediate 256 -> 64 per rank)" in r for r in named.rewrites)


def _tiny(model_type: str, **kw) -> PretrainedConfig:
    """A tiny config of model_type: hidden 64, 4 heads, vocab 512, 2 layers, and kw."""
    return AutoConfig.for_model(
        model_type, hidden_size=64, num_attention_heads=4, vocab_size=512, num_hidden_layers=2, **kw
    )


def test_experts_counted_from_their_stacked_weights_when_the_config_names_them_otherwise():
    """Aria names its routed experts `moe_num_experts`: the plan reads their count off the stacked weights."""
    aria = _tiny(
        "aria_text",
        num_key_value_heads=2,
        intermediate_size=32,
        moe_num_experts=4,
        moe_topk=2,
    )
    sharded = SHARDABLE | {"experts"}
    whole = make_plan(pc(4, 2, 1, 2, 4, moe_tp_size=4), aria, torch.bfloat16, sharded)
    split = make_plan(pc(4, 2, 1, 2, 4, moe_tp_size=1), aria, torch.bfloat16, sharded)
    assert "1 of 4 experts per rank" in "\n".join(split.rewrites)
    experts = 2 * 4 * 3 * 64 * 32 * BF16  # layers x experts x (gate, up, down) x hidden x intermediate
    assert whole.per_rank_param_bytes - split.per_rank_param_bytes == experts * 3 // 4


def test_a_plan_builds_the_meta_model_once_per_config(monkeypatch):
    # the expert count, validation and the bytes all read shapes off it (DeepSeek-V3's build takes ~1.6 s)
    from skills.parallel_impl import plan

    builds, build = [], plan._built_shapes
    monkeypatch.setattr(plan, "_built_shapes", lambda c: builds.append(c) or build(c))
    aria = _tiny("aria_text", num_key_value_heads=2, intermediate_size=32, moe_num_experts=4, moe_topk=2)
    make_plan(pc(4, 2, 1, 2, 4, moe_tp_size=1), aria, torch.bfloat16, SHARDABLE | {"experts"})
    make_plan(pc(4, 2, 1, 2, 4, moe_tp_size=4), aria, torch.bfloat16, SHARDABLE | {"experts"})
    assert builds == [aria]


def test_a_gate_inside_attention_follows_the_attention_tp_size():
    """AFMoE's `self_attn.gate_proj` is split by heads with q_proj (attn_tp), not like the MLP's gate_proj."""
    afmoe = _tiny(
        "afmoe",
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_dense_layers=2,
    )
    sharded = SHARDABLE | {"gate_proj"}
    dense_only = make_plan(pc(2, 1, 2, 2, 2), afmoe, torch.float32, sharded)
    with_attention = make_plan(pc(2, 2, 2, 2, 2), afmoe, torch.float32, sharded)
    attention = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 64 * 64) * 4  # layers x (q, k+v, o, gate) x fp32
    assert dense_only.per_rank_param_bytes - with_attention.per_rank_param_bytes == attention // 2


def test_mlp_widths_that_differ_per_layer_must_each_divide():
    """Gemma 3n gives each layer its own MLP width (`intermediate_size` is a list)."""
    gemma3n = _tiny(
        "gemma3n_text",
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=[64, 96],
        vocab_size_per_layer_input=512,
        hidden_size_per_layer_input=8,
        layer_types=["sliding_attention", "full_attention"],
        num_kv_shared_layers=0,
        laurel_rank=4,
        altup_num_inputs=2,
        activation_sparsity_pattern=[0.0, 0.0],
    )
    plan = make_plan(pc(2, 2, 2, 2, 2), gemma3n, torch.float32)
    assert "intermediate 64 / 96 -> 32 / 48 per rank" in "\n".join(plan.rewrites)
    message = rejected(pc(64, 64, 64, 64, 64), gemma3n)
    assert "intermediate_size 64 / 96 is not divisible by it" in message


def test_an_output_projection_role_keyed_by_its_owner_leaves_a_namesake_whole():
    """ModernBERT's attention and MLP both name a layer `Wo`: only `attn.Wo` is attention's row-parallel output."""
    cfg = _tiny(
        "modernbert-decoder",
        intermediate_size=128,
        attention_bias=False,
        pad_token_id=0,
    )
    sharded = frozenset({"q_proj", "k_proj", "v_proj"})  # `Wo` would be a namesake built parallel elsewhere
    plan = make_plan(pc(2, 2, 1, 2, 2), cfg, torch.float32, sharded, {"attn.Wo": "o_proj"})
    attention = 2 * 4 * 64 * 64 * 4  # layers x (q, k, v, Wo) x fp32
    assert plan.total_param_bytes - plan.per_rank_param_bytes == attention // 2


def test_a_namesake_of_an_owner_keyed_output_projection_built_parallel_is_sharded():
    """GPT-2's attention and MLP both name a layer `c_proj`, and both are parallel: attention's by its role, the
    MLP's (row-parallel, its bias whole) by its name."""
    cfg = _tiny("gpt2", n_inner=128, n_positions=64)
    sharded = frozenset({"c_attn", "c_fc", "c_proj"})
    plan = make_plan(pc(2, 2, 2, 2, 2), cfg, torch.float32, sharded, {"attn.c_proj": "o_proj"})
    attention = 64 * 3 * 64 + 3 * 64 + 64 * 64  # c_attn weight and bias, c_proj weight (its bias stays whole)
    mlp = 64 * 128 + 128 + 128 * 64  # c_fc weight and bias, c_proj weight
    assert plan.total_param_bytes - plan.per_rank_param_bytes == 2 * (attention + mlp) // 2 * 4
    # the steps name the model's own layers and the layers the rules build
    assert plan.rewrites[:2] == [
        (
            "c_attn (q, k and v blocks fused on disk) -> QKVParallelLinear (attn_tp=2: 2 of 4 heads and 2 of 4 kv heads "
            "per rank) on attn_tp_group"
        ),
        "c_proj -> RowParallelLinear (attn_tp=2) on attn_tp_group",
    ]


@pytest.mark.parametrize(
    ("sharded", "step"),
    [
        # GPT-NeoX's query_key_value interleaves q, k and v per head: split by whole heads
        (
            {"query_key_value", COLUMN_QKV},
            (
                "query_key_value (q, k and v interleaved per head on disk) -> "
                "ColumnParallelLinear by whole heads"
            ),
        ),
        # Gemma 3n-style k / v built only in some layers: a layer each
        ({"q_proj", "k_proj", "v_proj", COLUMN_QKV}, "q_proj/k_proj/v_proj -> ColumnParallelLinear each"),
    ],
)
def test_q_k_v_split_by_whole_heads_are_named_so(sharded, step):
    cfg = _tiny("gpt_neox" if "query_key_value" in sharded else "llama", intermediate_size=128)
    plan = make_plan(pc(2, 2, 2, 2, 2), cfg, torch.float32, frozenset(sharded | {"o_proj", "dense"}))
    assert plan.rewrites[0].startswith(step + " (attn_tp=2")


def test_key_heads_are_read_off_the_key_weights():
    # GPT-BigCode's multi_query config says nothing of key heads when one sets num_key_value_heads regardless
    sharded, roles = frozenset({"c_attn", "c_proj", "c_fc"}), {"attn.c_proj": "o_proj"}
    mqa = _tiny("gpt_bigcode", multi_query=True, num_key_value_heads=4, n_inner=128)
    plan = make_plan(pc(2, 2, 2, 2, 2), mqa, torch.float32, sharded, roles)
    assert "1 kv head (each of the 1 replicated on 2 ranks)" in plan.rewrites[0]
    mha = _tiny("gpt_bigcode", multi_query=False, n_inner=128)
    assert "2 of 4 kv heads" in make_plan(pc(2, 2, 2, 2, 2), mha, torch.float32, sharded, roles).rewrites[0]


def test_parameters_the_model_skips_loading_are_held_by_no_rank():
    """TrOCR's cross-attention (the migrated decoder runs without an encoder) is built by transformers but skipped
    by the model's `load_named_weights(..., ignored=[...])`: planned on no rank, sharded or not."""
    cfg = AutoConfig.for_model(
        "trocr", d_model=64, decoder_attention_heads=4, vocab_size=512, decoder_layers=2, decoder_ffn_dim=128
    )
    sharded = frozenset({"q_proj", "k_proj", "v_proj", "out_proj"})
    whole = make_plan(pc(2, 2, 2, 2, 2), cfg, torch.float32, sharded)
    unloaded = (r"(^|\.)encoder_attn\.", r"(^|\.)encoder_attn_layer_norm\.")
    plan = make_plan(pc(2, 2, 2, 2, 2), cfg, torch.float32, sharded, unloaded=unloaded)
    cross = (
        2 * (4 * 64 * 64 + 4 * 64 + 2 * 64) * 4
    )  # layers x (q, k, v, o weights and biases, its norm) x fp32
    assert whole.total_param_bytes - plan.total_param_bytes == cross
    cross_per_rank = (
        2 * (4 * 64 * 64 // 2 + 3 * 64 // 2 + 64 + 2 * 64) * 4
    )  # heads split, o's bias and norm whole
    assert whole.per_rank_param_bytes - plan.per_rank_param_bytes == cross_per_rank


def test_only_the_patterns_of_modules_the_migrated_model_does_not_build_are_unloaded():
    """MG024's `(^|\\.)<attr>\\.` name modules no part of the model uses; transformers' own (GPT-2's `attn.bias`,
    searched, also matches `c_attn.bias`) are left to the loader, which skips them only where nothing takes them."""
    code = 'load_named_weights(self, weights, ignored=["attn.bias", r"(^|\\.)crossattention\\.", r"(^|\\.)ln_cross\\."])\n'
    assert _unloaded({"modeling_gpt2.py": code}) == (r"(^|\.)crossattention\.", r"(^|\.)ln_cross\.")


BERT_SPLIT = """
class SelfOutput(nn.Module):
    def __init__(self, config, comm_manager, prefix):
        self.dense = RowParallelLinear(64, 64, tp_group="attn_tp_group")

class Intermediate(nn.Module):
    def __init__(self, config, comm_manager, prefix):
        self.dense = ColumnParallelLinear(64, 128, tp_group="dense_tp_group")

class Output(nn.Module):
    def __init__(self, config, comm_manager, prefix):
        self.dense = RowParallelLinear(128, 64, tp_group="dense_tp_group")

class Attention(nn.Module):
    def __init__(self, config, comm_manager, prefix):
        self.output = SelfOutput(config, comm_manager, prefix)

class Layer(nn.Module):
    def __init__(self, config, comm_manager, prefix):
        self.attention = Attention(config, comm_manager, prefix)
        if config.add_cross_attention:
            self.crossattention = Attention(config, comm_manager, prefix)
        self.intermediate = Intermediate(config, comm_manager, prefix)
        self.output = Output(config, comm_manager, prefix)

class LMHead(nn.Module):
    def __init__(self, config, comm_manager, prefix):
        self.decoder = ParallelLMHead(512, 64, bias=True, tp_group="lmhead_tp_group")

class Decoder(nn.Module):
    def __init__(self, config, comm_manager, prefix):
        self.lm_head = LMHead(config, comm_manager, prefix)
"""


def test_roles_of_layers_named_alike_are_keyed_by_as_much_of_their_path_as_tells_them_apart():
    """BERT's attention output (`attention.output.dense`, `crossattention.output.dense` where a branch builds
    cross-attention) and its MLP's down projection (`output.dense`) end alike; the MLP's layers, named `dense`, take
    the MLP's roles."""
    sharded, roles = _layers({"modeling_bert.py": BERT_SPLIT}, {})
    assert roles == {
        "attention.output.dense": "o_proj",
        "crossattention.output.dense": "o_proj",
        "intermediate.dense": "up_proj",
        "output.dense": "down_proj",
        "lm_head.decoder": "lm_head",
    }
    assert "dense" not in sharded
    name = "bert.encoder.layer.0.{}.weight"
    assert [_module(name.format(p), roles) for p in ("attention.output.dense", "output.dense")] == [
        "o_proj",
        "down_proj",
    ]


@pytest.mark.parametrize("tied", [True, False])
def test_a_head_built_in_a_module_of_its_own_holds_the_modules_bias_only_when_tied_to_it(tied):
    """BertGeneration's `lm_head.bias`: transformers lists it in place of the head's bias when tied, beside it
    (whole, unused) otherwise."""
    # a key-head count BERT does not read, as the catalogue's fixture sets it: the heads come off the `key` weights
    cfg = _tiny("bert-generation", intermediate_size=128, tie_word_embeddings=tied, num_key_value_heads=2)
    sharded, roles = _layers({"modeling_bert_generation.py": BERT_SPLIT}, {})
    sharded |= {"qkv_proj", "query", "key", "value", "word_embeddings"}
    roles |= {"query": "q_proj", "key": "k_proj", "value": "v_proj", "word_embeddings": "embed_tokens"}
    plan = make_plan(pc(2, 2, 2, 2, 2), cfg, torch.float32, sharded, roles)
    # every layer is split in two but the biases added after a sum and the norms
    whole = (
        2 * (64 + 64 + 2 * 64 + 2 * 64) + 2 * 64 + 512 * 64
    )  # layers x (o, down biases, norms), embeddings
    unused = 0 if tied else 512  # the module's own bias, whole
    assert (
        plan.per_rank_param_bytes
        == ((plan.total_param_bytes // 4 - whole - unused) // 2 + whole + unused) * 4
    )
    assert "2 of 4 heads and 2 of 4 kv heads per rank" in plan.rewrites[0]


def test_attention_run_whole_is_planned_whole_on_every_rank():
    """--replicate-attention: the classes named run whole (their groups still registered), their parameters are
    held whole by every rank, and an attention layout the plan does not know (JetMoE's attention experts, no
    o_proj) is no reason to refuse."""
    llama = _tiny("llama", num_key_value_heads=2, intermediate_size=128)
    mlp = SHARDABLE - {"q_proj", "k_proj", "v_proj", "o_proj"}
    whole = make_plan(pc(2, 2, 2, 2, 2), llama, torch.float32, mlp, replicated=["LlamaAttention"])
    sharded = make_plan(pc(2, 2, 2, 2, 2), llama, torch.float32, SHARDABLE)
    attention = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64) * 4  # layers x (q, k+v, o) x fp32
    assert whole.per_rank_param_bytes - sharded.per_rank_param_bytes == attention // 2
    assert "LlamaAttention run whole on every rank" in "\n".join(whole.rewrites)
    assert not any("QKVParallelLinear" in step for step in whole.rewrites)
    assert "attn_tp_group" in {g.name for g in whole.groups}
    jetmoe = _tiny("jetmoe", num_key_value_heads=2, kv_channels=16, intermediate_size=128)
    with pytest.raises(UserError, match="shards these attention layouts only"):
        make_plan(pc(2, 2, 2, 2, 2), jetmoe, torch.float32, mlp)
    make_plan(pc(2, 2, 2, 2, 2), jetmoe, torch.float32, mlp, replicated=["JetMoeAttention"])


INDEXED = textwrap.dedent("""\
    class Indexer(nn.Module):
        def __init__(self, config):
            self.q_proj = nn.Linear(64, 64, bias=False)
            self.k_proj = nn.Linear(64, 16, bias=False)
            self.index_cache = IndexKeyCache(16)


    class Attention(nn.Module):
        def __init__(self, config, comm_manager):
            self.qkv_proj = QKVParallelLinear(64, 16, 4, 2, comm_manager=comm_manager, tp_group="attn_tp_group")
            self.indexer = Indexer(config)


    class Layer(nn.Module):
        def __init__(self, config, comm_manager):
            self.self_attn = Attention(config, comm_manager)
    """)


def test_a_plain_linear_named_like_a_split_one_is_planned_whole():
    """MiniMax-M3's indexer projects with a `q_proj` and a `k_proj` of its own, plain linears beside attention's
    (fused into qkv_proj, split by heads): the plan holds the indexer's whole on every rank."""
    sharded, roles = _layers({"modeling_x.py": INDEXED}, {"qkv_proj": ("q_proj", "k_proj", "v_proj")})
    assert roles == {"indexer.q_proj": "whole", "indexer.k_proj": "whole"} and "q_proj" in sharded
    name = "model.layers.0.self_attn.{}.weight"
    assert [_module(name.format(p), roles) for p in ("q_proj", "indexer.q_proj")] == ["q_proj", "whole"]


def test_a_shared_experts_fused_gate_up_follows_the_dense_tp_size():
    """MiniMax-M3's shared experts fuse gate and up on disk (`shared_experts.gate_up_proj`): split over
    dense_tp_group (4 ranks), not attention's 2."""
    cfg = _tiny("minimax_m3_vl_text", num_key_value_heads=2, head_dim=16, shared_intermediate_size=128)
    cfg.num_local_experts, cfg.dense_intermediate_size, cfg.index_head_dim = 4, 128, 16
    sharded = SHARDABLE | {"gate_up_proj"}
    plan = make_plan(pc(4, 2, 4, 4, 4), cfg, torch.float32, sharded)
    shared = 2 * (2 * 128 * 64 + 64 * 128)  # layers x (gate_up, down)
    unsplit = make_plan(pc(4, 2, 4, 4, 4), cfg, torch.float32, sharded - {"gate_up_proj", "down_proj"})
    assert unsplit.per_rank_param_bytes - plan.per_rank_param_bytes == shared * 3 // 4 * 4


SUBCLASSED_HEAD = textwrap.dedent("""\
    class ScaledHead(ParallelLMHead):
        def __init__(self, config, comm_manager=None, prefix=""):
            super().__init__(512, 64, bias=False, comm_manager=comm_manager, tp_group="lmhead_tp_group", prefix=prefix)
            self.logit_scale = nn.Parameter(torch.ones(512))


    class DoryForCausalLM(nn.Module):
        def __init__(self, config, comm_manager, prefix):
            self.lm_head = ScaledHead(config, comm_manager=comm_manager, prefix=prefix)
    """)


def test_a_subclass_of_the_parallel_head_is_the_lm_head_its_own_parameters_whole():
    """Dory's head, made a subclass of ParallelLMHead: its weight split by vocabulary rows, its logit scale (one
    per vocabulary entry, applied to the gathered logits) whole on every rank."""
    sharded, roles = _layers({"modeling_dory.py": SUBCLASSED_HEAD}, {})
    assert "lm_head" in sharded and roles == {"lm_head": "lm_head"}
    cfg = tiny_config("dory")
    head = cfg.vocab_size * cfg.hidden_size
    split = make_plan(pc(2, 2, 2, 2, 2), cfg, torch.float32, SHARDABLE, roles)
    whole = make_plan(pc(2, 2, 2, 2, 1), cfg, torch.float32, SHARDABLE - {"lm_head"}, {})
    assert whole.per_rank_param_bytes - split.per_rank_param_bytes == head // 2 * 4


def test_stacked_shared_experts_are_planned_whole():
    """Inkling keeps its shared experts stacked in one module (`shared_experts.gate_proj` [n, width, hidden]), no
    layer the rules split: whole on every rank, as the rewritten model holds them (it was planned split like
    the routed experts' MLP, and parallelize refused the model it had rewritten)."""
    cfg = _tiny("inkling_text")
    plan = make_plan(
        pc(2, 2, 2, 2, 2), cfg, torch.float32, SHARDABLE | {"experts"}, replicated=("InklingAttention",)
    )
    shared = {n: s for n, s in _param_shapes(cfg).items() if "shared_experts" in n}
    assert shared and all(len(s) == 3 for s in shared.values())
    whole = sum(math.prod(s) for s in shared.values()) * 4
    without = make_plan(
        pc(2, 2, 2, 2, 2),
        cfg,
        torch.float32,
        SHARDABLE | {"experts"},
        unloaded=(r"shared_experts",),
        replicated=("InklingAttention",),
    )
    assert plan.per_rank_param_bytes - without.per_rank_param_bytes == whole
