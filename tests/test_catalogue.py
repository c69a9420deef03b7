"""scripts/catalogue.py on a small subset: a plain decoder PASSes through migrate + verify, a state-space
model without attention is OUT OF SCOPE with its reason, rows of other types survive a partial re-run, a traceback is a CRASH
and a clean error a REFUSED naming the construct."""

import json
import subprocess
import sys
from pathlib import Path

import catalogue
import pytest
from tiny_checkpoint import build_tiny_checkpoint, tiny_config

ROOT = Path(__file__).resolve().parent.parent


def sweep(out: Path, *types: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "catalogue.py"), "--out", str(out), "--only", *types],
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )


def test_subset_sweep_writes_the_table_and_keeps_other_rows(tmp_path):
    earlier = {"transformers": "x", "date": "x", "types": [{"model_type": "bart", "status": "OUT OF SCOPE"}]}
    (tmp_path / "coverage.json").write_text(json.dumps(earlier))
    proc = sweep(tmp_path, "llama", "mamba")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {e["model_type"]: e for e in json.loads((tmp_path / "coverage.json").read_text())["types"]}
    assert rows["llama"]["status"] == "PASS", rows["llama"]
    assert rows["mamba"]["status"] == "OUT OF SCOPE" and "state-space" in rows["mamba"]["reason"]
    assert not rows["llama"]["hybrid"]
    assert rows["bart"]["status"] == "OUT OF SCOPE"  # not re-checked, kept
    table = (tmp_path / "coverage.md").read_text()
    assert "| `llama` | PASS |" in table and "| `mamba` | OUT OF SCOPE |" in table and "`bart`" in table


def test_unknown_type_is_refused_before_any_work(tmp_path):
    proc = sweep(tmp_path, "no_such_model")
    assert proc.returncode == 2 and "no_such_model" in proc.stderr and not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "stderr,status,needle",
    [
        ("Traceback (most recent call last):\n  ...\nRuntimeError: size mismatch", "CRASH", "size mismatch"),
        ("error: X uses constructs the migrator cannot convert safely: alibi", "REFUSED", "alibi"),
    ],
)
def test_failures_are_classified(stderr, status, needle):
    entry = catalogue._failure("migrate", subprocess.CompletedProcess([], 1, "", stderr))
    assert entry.status == status and needle in entry.reason


def test_a_refusal_names_every_construct_by_its_path_in_the_package():
    found = [
        f"/home/u/.venv/lib/python3.11/site-packages/transformers/models/x/modeling_x.py:{n} in XAttention: "
        f"attention argument `a{n}=` has no equivalent in the runtime Attention [MG005]"
        for n in range(1, 6)
    ]
    stderr = f"error: X uses constructs the migrator cannot convert safely: {'; '.join(found)}. {catalogue.NOTHING_WRITTEN}"
    reason = catalogue._failure("migrate", subprocess.CompletedProcess([], 1, "", stderr)).reason
    assert "site-packages" not in reason and "transformers/models/x/modeling_x.py:5 in XAttention" in reason
    assert reason.endswith("`a5=` has no equivalent in the runtime Attention [MG005]")


def test_readme_architecture_list_is_generated_from_the_coverage_table():
    data = ROOT / "docs" / "coverage.json"
    version = json.loads(data.read_text())["transformers"]
    assert catalogue.readme_block(catalogue.load(data), version) in (ROOT / "README.md").read_text(), (
        "README.md's coverage block is stale: re-run scripts/catalogue.py (--only TYPE... for some types)"
    )


def test_attention_written_out_by_hand_passes(tmp_path):
    """XGLM (bmm over [B*H, T, D] inline in forward), GPT-Neo (a helper method, a banded causal buffer as a
    sliding window, its attention class looked up in a table, decoder layers called without **kwargs) and BLOOM
    (`alibi.baddbmm(...)`: ALiBi) convert with transformers' greedy tokens."""
    proc = sweep(tmp_path, "xglm", "gpt_neo", "bloom")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {e["model_type"]: e for e in json.loads((tmp_path / "coverage.json").read_text())["types"]}
    for passing in ("xglm", "gpt_neo", "bloom"):
        assert rows[passing]["status"] == "PASS", rows[passing]


def test_a_multimodal_wrapper_is_out_of_scope_even_with_its_towers_unset():
    """Gemma 4's defaults leave vision_config / audio_config None: declared towers still make it a wrapper."""
    assert "multimodal" in catalogue.out_of_scope("gemma4") and "vision_config" in catalogue.out_of_scope(
        "gemma4"
    )
    assert catalogue.out_of_scope("gemma4_text") is None


def test_a_model_that_embeds_image_inputs_itself_is_out_of_scope():
    """Fuyu has no vision tower: its config sizes the image patches its causal LM embeds; a text model's does not."""
    assert (
        catalogue.out_of_scope("fuyu")
        == "multimodal: the causal LM takes non-text inputs (image_size, image_token_id)"
    )
    assert catalogue.out_of_scope("persimmon") is None  # Fuyu's language model


def test_a_drafter_that_ignores_the_token_ids_is_out_of_scope():
    """Gemma 4's assistants take input_ids only to ignore them (they read the target model's states); every other
    causal LM reads them."""
    for drafter in ("gemma4_assistant", "gemma4_unified_assistant"):
        assert "forward ignores input_ids" in catalogue.out_of_scope(drafter)
    assert catalogue._reads_token_ids("gemma4_text") and catalogue._reads_token_ids("llama")


def test_state_kept_outside_the_cache_api_or_without_attention_is_out_of_scope():
    """Read from the modeling file: a recurrence's state kept by hand (xLSTM), or no softmax attention at all
    (RWKV, Mamba). Hybrids keeping theirs through transformers' cache API (LFM2's short convolution, Qwen3-Next's
    linear attention) are in scope, counted apart; attention-only files (Llama, Falcon's hand-written one) too."""
    assert "rnn_state" in catalogue.out_of_scope("xlstm") and "cache API" in catalogue.out_of_scope("xlstm")
    assert catalogue.out_of_scope("rwkv").startswith(
        "recurrent layers only, no softmax attention in modeling_rwkv"
    )
    assert catalogue.out_of_scope("mamba").startswith("state-space layers (linear_attention) only")
    for hybrid in ("lfm2", "qwen3_next"):
        assert catalogue.out_of_scope(hybrid) is None and catalogue.carried_state(hybrid)
    for plain in ("llama", "falcon"):
        assert catalogue.out_of_scope(plain) is None and catalogue.carried_state(plain) is None


@pytest.mark.parametrize("model_type,causal", [("xlnet", False), ("llama", True)])
def test_a_model_whose_earlier_positions_see_later_tokens_is_out_of_scope(tmp_path, model_type, causal):
    """XLNet attends both ways: appending tokens changes the logits at earlier positions, which no KV cache
    reproduces."""
    config = tiny_config(model_type)
    build_tiny_checkpoint(config, tmp_path, seed=0)
    reason = catalogue.not_causal(tmp_path, list(range(3, 19)))
    assert (reason is None) == causal, reason
    assert causal or reason.startswith("not causal: appending 8 tokens moves earlier positions' logits")
