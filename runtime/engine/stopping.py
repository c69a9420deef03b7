"""When a request stops, shared by the engine's scheduler and the standalone runner: EOS ids as the checkpoint
defines them, stop ids, and the token budget."""

from pathlib import Path

from transformers import GenerationConfig, PretrainedConfig

from runtime.engine.request import SamplingParams


def eos_token_ids(model_path: Path, hf_config: PretrainedConfig, tokenizer) -> tuple[int, ...]:
    """generation_config.json's eos_token_id, else the model config's, else the tokenizer's."""
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        eos = hf_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))


def finish_reason(
    output_token_ids: list[int], params: SamplingParams, eos: tuple[int, ...] | set[int]
) -> str | None:
    """ "stop" (a stop id, or EOS unless ignored), "length" (max_new_tokens reached) or None (go on)."""
    last = output_token_ids[-1]
    if last in params.stop_token_ids or (not params.ignore_eos and last in eos):
        return "stop"
    return "length" if len(output_token_ids) >= params.max_new_tokens else None
