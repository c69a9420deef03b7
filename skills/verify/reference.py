"""transformers' side of `skill verify`: a plain greedy loop over the checkpoint (no generation config, no
logits processors, no EOS stop), keeping every step's log-probabilities, each prompt answered as a freshly loaded
model answers it alone."""

import inspect
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.engine.float64 import in_dtype
from runtime.errors import UserError
from runtime.layers.rotary import rope_states


@dataclass
class Reference:
    tokens: list[int]
    logprobs: torch.Tensor  # [steps, vocab], float32 (float64 in a float64 run)


def load_reference_model(model_path: Path, dtype: torch.dtype, trust_remote_code: bool):
    """transformers' model of the checkpoint in dtype; in float64 built as the runtime builds it (what it computes
    in float32 as it is built, RoPE's frequencies, in float64) and ready to run under ``Float64``."""
    from transformers import AutoModelForCausalLM

    try:
        with in_dtype(dtype):
            model = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=dtype, trust_remote_code=trust_remote_code
            ).eval()
    except (OSError, ValueError, KeyError) as e:
        raise UserError(
            f"transformers cannot load {model_path} ({str(e).splitlines()[0][:300]}); verification "
            "needs a checkpoint transformers reads, with its model type in the installed "
            "transformers."
        ) from e
    return in_float64(model) if dtype == torch.float64 else model


def in_float64(model: torch.nn.Module) -> torch.nn.Module:
    """model in float64, its experts run one by one: torch's grouped matmul (transformers' default for them) takes
    no float64."""
    if getattr(model.config, "_experts_implementation", "eager") != "eager":
        model.set_experts_implementation("eager")
    return model.double()


class ReferenceFailed(UserError):
    """transformers' own run of the checkpoint raised: there is nothing to compare with."""


def greedy_reference(model, prompt_ids: list[int], steps: int) -> Reference:
    """The greedy loop, leaving the model's RoPE state as it found it."""
    # transformers' dynamic RoPE keeps frequencies grown for the longest sequence seen; put back, a prompt's answer
    # does not depend on how long the prompts before it ran, as in the runtime, which answers each afresh
    ropes = rope_states(model)
    try:
        return _greedy(model, prompt_ids, steps)
    finally:
        for rope in ropes:
            rope.restore()


def _forward(model, *args, **kwargs):
    """The model's own forward; what it raises (the checkpoint's code, remote code above all, under the installed
    transformers) means there is nothing to compare with."""
    try:
        return model(*args, **kwargs)
    except Exception as e:
        raise ReferenceFailed(
            f"transformers' own run of {type(model).__name__} failed ({type(e).__name__}: {str(e)[:300]}), so "
            "there is no reference to compare with; check that the checkpoint's code runs under the installed "
            "transformers (`generate` on it fails the same way)."
        ) from e


@torch.inference_mode()
def _greedy(model, prompt_ids: list[int], steps: int) -> Reference:
    # transformers 5.x renamed `past_key_values` to `cache` in forward() and its outputs, model by model;
    # a model without either (GPT-1) reads the whole sequence at every step
    params = inspect.signature(model.forward).parameters
    cache_arg = next((a for a in ("cache", "past_key_values") if a in params), None)
    ids = list(prompt_ids)
    out = _forward(model, torch.tensor([ids]), **({"use_cache": True} if cache_arg else {}))
    tokens, logprobs = [], []
    for step in range(steps):
        logits = out.logits[0, -1]
        logp = torch.log_softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
        token = int(logp.argmax())
        tokens.append(token)
        logprobs.append(logp)
        if step + 1 == steps:
            break
        if cache_arg:
            # the token's position given, as generate() gives it: Bamba numbers a forward's tokens from 0 when
            # not told their positions, whatever its cache holds
            position = {"position_ids": torch.tensor([[len(ids) + step]])} if "position_ids" in params else {}
            out = _forward(
                model,
                torch.tensor([[token]]),
                use_cache=True,
                **position,
                **{cache_arg: getattr(out, cache_arg)},
            )
        else:
            ids.append(token)
            out = _forward(model, torch.tensor([ids]))
    return Reference(tokens, torch.stack(logprobs))
