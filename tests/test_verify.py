"""`skill verify`: a migrated directory is compared with transformers on the same weights; a hand edit that
changes greedy tokens is caught (exit 4, prompt and position named) and recorded, not hidden."""

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from skill_process import skill, skill_json
from tiny_checkpoint import PARITY_PROMPTS

from runtime.engine.float64 import Float64
from runtime.engine.model_worker import default_dtype
from skills.verify import reference
from skills.verify.compare import compare
from skills.verify.reference import Reference, greedy_reference, load_reference_model
from skills.verify.verify import settled_in_float64


@pytest.fixture(scope="module")
def migrated(tiny_llama_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("verify")
    return Path(skill_json("migrate", tiny_llama_dir, "-o", out, "--no-run", "--json")["model_dir"])


def verify(model_dir: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict]:
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PARITY_PROMPTS[:2]))
    proc = skill("verify", str(model_dir), "--prompts-file", str(prompts), "--tokens", "6", "--json")
    return proc, json.loads(proc.stdout) if proc.stdout else {}


def recorded(model_dir: Path) -> tuple[dict, str]:
    metadata = json.loads((model_dir / "agentic" / "baseline" / "baseline_metadata.json").read_text())
    readme = (model_dir / "README.md").read_text()
    return metadata["verification"], readme[readme.index("## Verified") :]


def test_unchanged_directory_is_identical(migrated, tmp_path):
    proc, result = verify(migrated, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert result["identical"] and result["tokens_compared"] == 12 and result["first_difference"] is None
    assert result["max_logprob_diff"] < result["logprob_atol"] == 2e-3
    verification, section = recorded(migrated)
    assert verification["identical"] is True and verification["prompts"] == PARITY_PROMPTS[:2]
    assert section.startswith("## Verified\n\nGreedy tokens identical to transformers: 12 tokens compared")


def test_altered_constant_is_a_mismatch_naming_prompt_and_position(migrated, tmp_path):
    altered = tmp_path / "altered"
    subprocess.run(["cp", "-r", str(migrated), str(altered)], check=True)
    modeling = altered / "models" / "modeling_llama.py"
    code, n = re.subn(
        r"(?<![\w.])scaling = self\.head_dim\*\*-0\.5", "scaling = self.head_dim**0.5", modeling.read_text()
    )
    assert n == 1
    modeling.write_text(code)
    proc, result = verify(altered, tmp_path)
    assert proc.returncode == 4, proc.stderr[-2000:]
    first = result["first_difference"]
    assert not result["identical"] and first["prompt"] in PARITY_PROMPTS[:2]
    assert first["migrated_token"] != first["transformers_token"]
    named = f"on prompt {first['prompt_index']} ({first['prompt']!r}) at generated token {first['position']}"
    assert named in " ".join(proc.stderr.split())
    verification, section = recorded(altered)
    assert verification["identical"] is False and verification["first_difference"] == first
    assert section.startswith("## Verified\n\n**Mismatch** on prompt")


def test_checkpoint_transformers_cannot_load_is_reported(migrated, tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a config without weights, like pre-sharded rank_<r>/ dirs
    doc = yaml.safe_load((migrated / "config" / "llama.yaml").read_text())
    doc["model_config"]["model_path"] = str(tmp_path)
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(doc))
    proc = skill("verify", str(migrated), "--yaml", str(other))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "not a checkpoint transformers can load" in " ".join(proc.stderr.split())


def test_parallelize_verifies_the_multi_rank_run(migrated, tmp_path):
    tp2 = tmp_path / "tp2.yaml"
    tp2.write_text(
        yaml.safe_dump(
            {
                "parallel_config": {
                    "world_size": 2,
                    "attn_tp_size": 2,
                    "dense_tp_size": 2,
                    "embed_tp_size": 2,
                    "lmhead_tp_size": 2,
                }
            }
        )
    )
    proc = skill("parallelize", str(migrated), "--config", str(tp2), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    done = json.loads(proc.stdout)
    verification = done["verification"]
    assert verification["identical"] and verification["world_size"] == 2, verification
    assert verification["yaml"] == str(Path(done["yaml"]).relative_to(migrated))
    assert recorded(migrated)[0]["world_size"] == 2


def _run_output(tokens: list[int], logprobs: torch.Tensor) -> dict:
    return {
        "prompt": "p",
        "token_ids": tokens,
        "logprobs": [{"top": [[t, float(logprobs[i, t])]]} for i, t in enumerate(tokens)],
    }


@pytest.mark.parametrize(
    ("gap", "allow", "status"),
    [(0.1, True, "near_tie"), (0.1, False, "mismatch"), (0.5, True, "mismatch")],
)
def test_a_prompt_parting_at_a_near_tie_is_told_apart_from_a_mismatch(gap, allow, status):
    """Activation-quantized checkpoints: where transformers rates our pick within the tolerance of its own, the
    prompt is compared up to there and called a near tie; a wider gap, or other checkpoints, a mismatch."""
    logprobs = torch.full((3, 4), -5.0)
    logprobs[:, 0] = -0.1
    logprobs[1, 2] = -0.1 - gap  # step 1: transformers picks 0, ours picks 2
    reference = Reference([0, 0, 0], logprobs)
    ours = _run_output([0, 2, 1], logprobs)
    fields = compare([ours], [reference], "float32", lambda ids: str(ids), 0.25, allow_near_ties=allow)
    assert fields["status"] == status and fields["tokens_compared"] == 2
    differences = fields["near_ties"] if status == "near_tie" else [fields["first_difference"]]
    assert [(d.position, d.migrated_token, d.transformers_token) for d in differences] == [(1, 2, 0)]


def test_a_model_without_a_cache_is_rerun_over_the_whole_sequence(tiny_llama_dir):
    """GPT-1's forward takes no cache: the reference reads the whole sequence at every step instead."""
    model = load_reference_model(tiny_llama_dir, torch.float32, trust_remote_code=False)

    class WithoutCache(torch.nn.Module):
        def forward(self, input_ids):
            return model(input_ids, use_cache=False)

    cached = greedy_reference(model, [1, 5, 9, 3], 6)
    uncached = greedy_reference(WithoutCache(), [1, 5, 9, 3], 6)
    assert uncached.tokens == cached.tokens
    torch.testing.assert_close(uncached.logprobs, cached.logprobs, atol=1e-4, rtol=0)


def test_float64_runs_agree_to_the_last_bit(migrated, tmp_path):
    """The runtime runs float64 (verify's check when float32 drifts): transformers' log-probabilities exactly."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PARITY_PROMPTS[:1]))
    proc = skill(
        "verify",
        str(migrated),
        "--prompts-file",
        str(prompts),
        "--tokens",
        "4",
        "--dtype",
        "float64",
        "--json",
    )
    result = json.loads(proc.stdout)
    assert proc.returncode == 0 and result["identical"] and result["max_logprob_diff"] <= 1e-6, proc.stderr[
        -2000:
    ]


@pytest.mark.parametrize(("in_float64", "status"), [("identical", "identical"), ("mismatch", "mismatch")])
def test_float32_drift_with_agreeing_tokens_is_settled_in_float64(in_float64, status):
    """hrm_text's random 16-pass recurrence moves float32 log-probabilities by 0.04 between any two
    implementations: the conversion passes when the two runs agree in float64."""
    drift = {"status": "mismatch", "first_difference": None, "max_logprob_diff": 0.04, "reason": "drift"}
    exact = {"status": in_float64, "max_logprob_diff": 0.0, "tokens_compared": 64}
    fields = settled_in_float64(drift, exact)
    assert fields["status"] == status and fields["max_logprob_diff"] == 0.04
    assert fields["reason"].startswith("float32 rounding" if status == "identical" else "drift; in float64")


def test_a_reference_whose_experts_run_grouped_runs_in_float64():
    """transformers runs experts through torch's grouped matmul by default, which takes no float64: verify's float64
    check runs them one by one (Inkling's drift was settled so)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    sizes = {"hidden_size": 32, "intermediate_size": 32, "moe_intermediate_size": 16, "head_dim": 16}
    config = Qwen3MoeConfig(
        vocab_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, **sizes
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    assert model.config._experts_implementation == "grouped_mm"
    with torch.no_grad():
        assert reference.in_float64(model)(torch.tensor([[1, 2, 3]])).logits.dtype == torch.float64


class _PinsFloat32(torch.nn.Module):
    """A router as transformers writes them: its weight, its input and its softmax pinned to float32."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.nn.functional.linear(x.float(), self.weight.to(torch.float32))
        return torch.softmax(scores, -1, dtype=torch.float32) + torch.zeros(3)


def test_code_pinned_to_float32_runs_in_float64_under_float64():
    """A float64 run of code that pins parts to float32 (Inkling2-Loop's routers and message gates) rounds them to
    float32, or mixes the two dtypes and fails; under `Float64`, built and run, it computes in float64 throughout,
    as verify's check needs, and the default dtype comes back afterwards."""
    x = torch.randn(2, 4, dtype=torch.float64)
    with default_dtype(torch.float64):
        module = _PinsFloat32()
    assert module.weight.dtype == torch.float64 and torch.get_default_dtype() == torch.float32
    assert module(x).dtype == torch.float32
    with Float64():
        out = module(x)
    assert out.dtype == torch.float64 and torch.get_default_dtype() == torch.float32
    torch.testing.assert_close(out, torch.softmax(x @ module.weight.T, -1), atol=1e-15, rtol=0)


def test_each_cached_step_is_told_its_position(tiny_llama_dir):
    """Bamba numbers a forward's tokens from 0 unless given `position_ids`, whatever its cache holds: the
    reference gives each step its position, as generate() does."""
    model = load_reference_model(tiny_llama_dir, torch.float32, trust_remote_code=False)
    seen = []

    class Recording(torch.nn.Module):
        def forward(self, input_ids, position_ids=None, cache=None, use_cache=False):
            seen.append(None if position_ids is None else position_ids.tolist())
            return model(input_ids, position_ids=position_ids, past_key_values=cache, use_cache=use_cache)

    greedy_reference(Recording(), [1, 5, 9, 3], 4)
    assert seen == [None, [[4]], [[5]], [[6]]]


def test_each_prompt_is_answered_as_a_freshly_loaded_model_answers_it():
    """transformers' dynamic NTK RoPE keeps the frequencies it grew for the longest sequence it has seen; the
    runtime answers each request as a fresh model does, so the reference puts them back after each prompt."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=8,
        rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    prompt = list(range(1, 11))  # past the 8 positions: the frequencies grow
    alone = greedy_reference(model, prompt, 3)
    greedy_reference(model, list(range(20, 40)), 8)  # grows them further
    after = greedy_reference(model, prompt, 3)
    assert after.tokens == alone.tokens
    torch.testing.assert_close(after.logprobs, alone.logprobs, rtol=0, atol=0)


def test_a_reference_model_that_cannot_run_is_named_not_a_traceback():
    """Remote code that fails under the installed transformers leaves verify nothing to compare with: it says so
    (the check is then skipped with that reason) instead of crashing."""
    from skills.verify.reference import ReferenceFailed

    class Broken(torch.nn.Module):
        def forward(self, input_ids, use_cache=False, cache=None):
            raise AttributeError("'GLMConfig' object has no attribute 'num_hidden_layers'")

    with pytest.raises(
        ReferenceFailed, match="transformers' own run of Broken failed .AttributeError: 'GLMConfig'"
    ):
        greedy_reference(Broken(), [1, 2], 3)
