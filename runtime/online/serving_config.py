"""The engine configuration a server runs: the model directory's YAML with the server's context length."""

from pathlib import Path

from runtime.config import InferenceConfig


def serving_config(yaml_path: Path, max_model_len: int | None = None) -> InferenceConfig:
    """`max_model_len` (prompt + output tokens) sizes the KV cache per request; by default the YAML's
    input_truncated_len + max_new_tokens."""
    config = InferenceConfig.from_yaml(yaml_path)
    if max_model_len is not None:  # the server bounds prompt + output; only their sum sizes the cache
        sc = config.scheduler_config
        sc.max_new_tokens = min(sc.max_new_tokens, max_model_len - 1)
        config.data_config.input_truncated_len = max_model_len - sc.max_new_tokens
    return config
