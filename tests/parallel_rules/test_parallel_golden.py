"""Golden parallelize: migrated modeling files (the installed transformers' llama / qwen3 / mistral through
`convert_code`) go through every parallel rule and come out compiling and ruff-clean, with no nn.Linear /
nn.Embedding left, the expected rewrites recorded, and unchanged by a second pass; the smollm2 demo model,
when present, is written with its parallel layers already and passes unchanged."""

import functools
from pathlib import Path

import migrated_code
import pytest
from migrated_code import ARCHS, paths, ruff_check

from skills.migrator.codestyle import tidy
from skills.parallel_impl.rewrite import ParallelRewriteContext, parallelize_source

REPO = Path(__file__).resolve().parents[2]
SMOLLM2 = REPO / "models/smollm2_135m_instruct/models/modeling_smollm2_135m_instruct.py"
# mistral is llama's layout: `-m slow`, for `make test`'s 30 minutes
CASES = [
    "llama",
    "qwen3",
    pytest.param("mistral", marks=pytest.mark.slow),
]
FUSED = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]


def migrated(case: str) -> tuple[str, str, str]:
    """(migrated modeling code, entry class, file name)."""
    if case == "smollm2":
        return SMOLLM2.read_text(), "LlamaForCausalLM", SMOLLM2.name
    modeling, _ = paths(case)
    return migrated_code.converted(case, "paged")[modeling], ARCHS[case], Path(modeling).name


def expected_rewrites(entry: str) -> list[str]:
    arch = entry.removesuffix("ForCausalLM")
    return [
        f"{arch}Attention: q_proj/k_proj/v_proj -> QKVParallelLinear qkv_proj (attn_tp_group)",
        f"{arch}Attention: o_proj -> RowParallelLinear (attn_tp_group)",
        f"{arch}MLP: gate_proj/up_proj -> MergedColumnParallelLinear gate_up_proj (dense_tp_group)",
        f"{arch}MLP: down_proj -> RowParallelLinear (dense_tp_group)",
        f"{arch}Model: embed_tokens -> VocabParallelEmbedding (embed_tp_group)",
        f"{entry}: lm_head -> ParallelLMHead (lmhead_tp_group), tied to self.model.embed_tokens via tie_weights",
        f"{entry}: forward feeds the model this rank's chunk of the input ids and gathers the tokens of every rank before the LM head",
        f"{entry}: init_parallel_comm_group registers attn_tp_group, dense_tp_group, embed_tp_group, lmhead_tp_group",
        f"{entry}: load_weights loads gate_up_proj, qkv_proj from their checkpoint parts",
    ]


@functools.cache
def parallelized(case: str) -> tuple[str, ParallelRewriteContext]:
    """(tidied output, its context); 1-2 s of CPU each."""
    code, entry, filename = migrated(case)
    ctx = ParallelRewriteContext(entry_class=entry, filename=filename)
    return tidy(parallelize_source(code, ctx), filename), ctx


@pytest.mark.parametrize("case", CASES)
def test_parallelized_code_is_clean(case):
    out, ctx = parallelized(case)
    _, entry, filename = migrated(case)
    assert ctx.findings == []
    assert ctx.rewrites == expected_rewrites(entry)
    assert ctx.fused == FUSED
    compile(out, filename, "exec")
    assert ruff_check(out, filename) == ""
    assert "nn.Linear(" not in out and "nn.Embedding(" not in out
    for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        assert f"self.{name}" not in out
    assert out.count("self.tp_region = TPRegion(") == 2
    assert "self.init_parallel_comm_group(infer_config, comm_manager)" in out


@pytest.mark.parametrize("case", CASES)
def test_parallelize_is_idempotent(case):
    out, _ = parallelized(case)
    _, entry, filename = migrated(case)
    ctx = ParallelRewriteContext(entry_class=entry, filename=filename)
    assert tidy(parallelize_source(out, ctx), filename) == out
    assert ctx.rewrites == ctx.fused == ctx.findings == []


@pytest.mark.skipif(not SMOLLM2.is_file(), reason="no demo (`make demo` writes it)")
def test_the_demo_model_is_written_parallel_already():
    """`skill migrate` writes parallel layers at TP 1 with fused projections: nothing is left to rewrite."""
    code, entry, filename = migrated("smollm2")
    ctx = ParallelRewriteContext(entry_class=entry, filename=filename)
    assert tidy(parallelize_source(code, ctx), filename) == code
    assert ctx.rewrites == ctx.findings == []
