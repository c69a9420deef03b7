from runtime.config.inference_config import (
    DataConfig,
    DisaggConfig,
    InferenceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)

__all__ = [
    "DataConfig",
    "DisaggConfig",
    "InferenceConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
]
