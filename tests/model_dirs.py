"""Build runnable model directories (contract code + YAML) around test checkpoints."""

import shutil
from pathlib import Path

import yaml

FIXTURES = Path(__file__).parent / "fixtures"


def make_model_dir(
    root: Path,
    checkpoint: Path,
    name: str = "contract_llama",
    kv_layout: str = "paged",
    models_src: Path = FIXTURES / "contract_llama" / "models",
    **scheduler,
) -> Path:
    model_dir = root / name
    shutil.copytree(models_src, model_dir / "models", dirs_exist_ok=True)
    (model_dir / "config").mkdir(parents=True, exist_ok=True)
    config = {
        "model_name": name,
        "world_size": 1,
        "model_config": {
            "model_name": name,
            "model_path": str(checkpoint),
            "dtype": "float32",
            "with_ckpt": True,
            "custom_params": {"kv_layout": kv_layout},
        },
        "data_config": {"dataset": "default", "input_truncated_len": 64},
        "parallel_config": {"world_size": 1},
        "scheduler_config": {"batch_size": 4, "max_new_tokens": 16, "block_size": 8, **scheduler},
    }
    (model_dir / "config" / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return model_dir


def prefill_logits(model_dir: Path, prompts_ids: list[list[int]]):
    """Last-position logits [B, V] of one packed prefill of prompts_ids, run by the runtime on model_dir (on the
    device it picks), returned on the host beside transformers' reference."""
    return prefilled(model_dir, prompts_ids)[1]


def prefilled(model_dir: Path, prompts_ids: list[list[int]]):
    """(the engine, prefill_logits) after one packed prefill of prompts_ids on model_dir."""
    from runtime.config import InferenceConfig
    from runtime.distributed import init_distributed
    from runtime.engine.execution_engine import ExecutionEngine
    from runtime.engine.request import Batch, Request

    config = InferenceConfig.from_yaml(model_dir / "config" / f"{model_dir.name}.yaml")
    engine = ExecutionEngine(config, init_distributed(), model_dir)
    engine.init()
    requests = [Request(ids) for ids in prompts_ids]
    for r in requests:
        assert engine.kv.allocate_slots(r.request_id, 0, r.num_tokens)
    return engine, engine.forward_batch(Batch(requests, is_prefill=True))["logits"][:, 0].cpu()
