"""Memory estimate from config shapes, checked against real parameter counts of tiny transformers models."""

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from skills.migrator.memory import MemoryEstimate, available_memory, estimate_memory, fits

COMMON = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
CONFIGS = {
    "llama": {"tie_word_embeddings": False},
    "qwen3": {"head_dim": 32, "tie_word_embeddings": False},
    "gemma3_text": {"head_dim": 16},
    "qwen3_moe": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "mlp_only_layers": [0],
        "tie_word_embeddings": False,
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False},
}


@pytest.mark.parametrize("model_type", CONFIGS)
def test_param_count_matches_model(model_type: str):
    config = AutoConfig.for_model(model_type, **COMMON, **CONFIGS[model_type])
    actual = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    estimate = estimate_memory(config, torch.bfloat16, batch_size=1, max_seq_len=1)
    assert abs(estimate.params - actual) / actual < 0.02, (estimate.params, actual)
    assert estimate.param_bytes == 2 * estimate.params


def test_kv_bytes():
    config = AutoConfig.for_model("qwen3", **COMMON, head_dim=32)
    estimate = estimate_memory(config, torch.float32, batch_size=4, max_seq_len=1000)
    assert estimate.kv_bytes == 2 * 3 * 2 * 32 * 4 * 1000 * 4
    assert estimate.total_bytes == estimate.param_bytes + estimate.kv_bytes


def test_fits():
    estimate = MemoryEstimate(params=0, param_bytes=80, kv_bytes=10, total_bytes=90)
    assert fits(estimate, 100) and not fits(estimate, 99) and fits(estimate, 95, headroom=1.0)


def test_available_cpu_memory():
    if not Path("/proc/meminfo").exists():
        pytest.skip("needs Linux /proc/meminfo")
    assert available_memory(torch.device("cpu")) > 0


def test_weights_are_counted_from_the_checkpoint_and_other_config_names_give_no_kv_figure(tmp_path):
    """Remote code's config names its sizes its own way (`num_layers`, `kv_channels`): the weights come from the
    checkpoint's tensor headers, and the KV cache is left to the runtime's pool sizing instead of a crash."""
    from safetensors.torch import save_file
    from transformers import PretrainedConfig

    save_file(
        {"a.weight": torch.zeros(3, 5), "b.weight": torch.zeros(7)}, str(tmp_path / "model.safetensors")
    )
    config = PretrainedConfig(num_layers=2, kv_channels=16, padded_vocab_size=512)
    estimate = estimate_memory(config, torch.float32, batch_size=1, max_seq_len=8, checkpoint=tmp_path)
    assert (estimate.params, estimate.param_bytes, estimate.kv_bytes) == (22, 88, 0)
    llama = AutoConfig.for_model("llama", **COMMON)
    from_config = estimate_memory(llama, torch.float32, batch_size=1, max_seq_len=8)
    assert (
        estimate_memory(llama, torch.float32, 1, 8, checkpoint=tmp_path).params == 22
    )  # the checkpoint wins
    assert from_config.params > 22 and from_config.kv_bytes > 0


def test_a_sharded_checkpoint_counts_the_shards_its_index_names(tmp_path):
    """Mistral-style folders keep a consolidated copy beside the shards: it is not counted twice."""
    import json

    from safetensors.torch import save_file
    from transformers import PretrainedConfig

    save_file({"a.weight": torch.zeros(4)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    save_file({"a.weight": torch.zeros(4)}, str(tmp_path / "consolidated.safetensors"))
    index = {"metadata": {}, "weight_map": {"a.weight": "model-00001-of-00001.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert estimate_memory(PretrainedConfig(), torch.float32, 1, 1, checkpoint=tmp_path).params == 4
