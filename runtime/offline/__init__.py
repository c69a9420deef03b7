from runtime.offline.offline_inference import GenerationOutput, OfflineInference
from runtime.offline.prompts import prompts_from_config, read_prompts_file

__all__ = ["GenerationOutput", "OfflineInference", "prompts_from_config", "read_prompts_file"]
