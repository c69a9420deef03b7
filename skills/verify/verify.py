"""`skill verify`: run a model directory and transformers on the same weights, greedy, and compare them token
for token (and log-probability within a tolerance)."""

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import torch
import yaml

from runtime.config import InferenceConfig
from runtime.engine.float64 import in_dtype
from runtime.engine.loader import checkpoint_quantization
from runtime.errors import UserError
from skills.migrator.memory import available_memory
from skills.migrator.pipeline import checkpoint_dtype
from skills.verify.compare import LOGPROB_ATOL, Verification, compare, logprob_atol
from skills.verify.reference import ReferenceFailed, greedy_reference, load_reference_model

DEFAULT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "Water boils at a temperature of",
]
DEFAULT_TOKENS = 16
TOP_LOGPROBS = 5
EXIT_MISMATCH = 4


class VerificationMismatch(UserError):
    exit_code = EXIT_MISMATCH


def _relative(path: Path, root: Path) -> str:
    path, root = path.resolve(), root.resolve()
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def _why_not(config: InferenceConfig, dtype: torch.dtype) -> str:
    """Why transformers cannot run this checkpoint here ('' when it can)."""
    mc = config.model_config
    path = Path(mc.model_path)
    weights = [*path.glob("*.safetensors"), *path.glob("*.bin")]
    if not (path / "config.json").is_file() or not weights:
        return (
            f"model_path {path} is not a checkpoint transformers can load (no config.json with *.safetensors "
            "or *.bin next to it; pre-sharded rank_<r>/ weights cannot be compared)"
        )
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 2 * (os.cpu_count() or 1)
    if config.world_size > devices:
        return (
            f"world_size {config.world_size} does not fit this machine ({devices} ranks at most here); "
            "verify where the world fits"
        )
    if mc.custom_params.get("remote_code") and not mc.trust_remote_code:
        return (
            "the checkpoint's model code is remote code; pass --trust-remote-code to let transformers run it"
        )
    saved = checkpoint_dtype(json.loads((path / "config.json").read_text()), "auto")
    needed = sum(f.stat().st_size for f in weights) * dtype.itemsize // getattr(torch, saved).itemsize
    free = available_memory(torch.device("cpu"))
    if needed > 0.9 * free:
        return (
            f"transformers' copy of the weights needs about {needed / 2**30:.1f} GiB in {dtype}, "
            f"{free / 2**30:.1f} GiB is free; verify on a bigger machine or with --dtype bfloat16"
        )
    return ""


def _run_migrated(
    model_dir: Path, yaml_file: Path, prompts: list[str], tokens: int, dtype: str, trust_remote_code: bool
) -> list[dict]:
    """`skill run --json --logprobs` of the model directory with the YAML's dtype and lengths overridden."""
    doc = yaml.safe_load(yaml_file.read_text(encoding="utf-8"))
    doc["model_config"].update(dtype=dtype, trust_remote_code=trust_remote_code)
    doc.setdefault("scheduler_config", {}).update(max_new_tokens=tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory(prefix="skill-verify-") as tmp:
        run_yaml, prompts_file = Path(tmp) / yaml_file.name, Path(tmp) / "prompts.json"
        run_yaml.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
        prompts_file.write_text(json.dumps(prompts), encoding="utf-8")
        cmd = [
            sys.executable,
            "-m",
            "skills.cli",
            "run",
            str(model_dir.resolve()),
            "--yaml",
            str(run_yaml),
            "--prompts-file",
            str(prompts_file),
            "--raw",
            "--json",
            "--logprobs",
            str(TOP_LOGPROBS),
        ]
        env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=model_dir, env=env, check=False)
    if proc.returncode != 0:
        raise UserError(
            f"the migrated model's run failed, so nothing could be compared (`skill run {model_dir} "
            f"--yaml {yaml_file}` reproduces it): {proc.stderr.strip()[-600:]}"
        )
    return json.loads(proc.stdout.splitlines()[-1])["outputs"]


def verify(
    model_dir: Path,
    yaml_file: Path,
    prompts: list[str] | None = None,
    tokens: int = DEFAULT_TOKENS,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    log=lambda msg: None,
) -> Verification:
    """The greedy comparison of model_dir (run with yaml_file) against transformers; `skipped` with a reason
    when transformers cannot load the checkpoint or both do not fit in memory."""
    if dtype not in LOGPROB_ATOL:
        raise UserError(f"--dtype {dtype!r} is not one of {', '.join(LOGPROB_ATOL)}.")
    config = InferenceConfig.from_yaml(yaml_file)
    trust_remote_code = trust_remote_code or config.model_config.trust_remote_code
    config.model_config.trust_remote_code = trust_remote_code
    prompts = prompts or DEFAULT_PROMPTS
    torch_dtype = getattr(torch, dtype)
    result = Verification(
        "skipped",
        dtype=dtype,
        world_size=config.world_size,
        yaml=_relative(yaml_file, model_dir),
        prompts=prompts,
        tokens_per_prompt=tokens,
        checked_at=datetime.now().astimezone().isoformat(timespec="seconds"),
    )
    if reason := _why_not(config, torch_dtype):
        return replace(result, reason=reason)
    log(
        f"running {model_dir} ({config.world_size} rank(s), {dtype}) on {len(prompts)} prompts x {tokens} tokens"
    )
    outputs = _run_migrated(model_dir, yaml_file, prompts, tokens, dtype, trust_remote_code)
    log("running transformers on the same weights and prompt tokens")
    model = load_reference_model(Path(config.model_config.model_path), torch_dtype, trust_remote_code)
    try:
        references = _references(model, outputs, tokens, torch_dtype)
    except ReferenceFailed as e:
        return replace(result, reason=str(e))
    from transformers import AutoTokenizer, __version__

    tokenizer = AutoTokenizer.from_pretrained(
        config.model_config.model_path, trust_remote_code=trust_remote_code
    )
    result = replace(result, reference=f"transformers {__version__} {type(model).__name__}")
    scheme = checkpoint_quantization(Path(config.model_config.model_path))
    quantized_activations = scheme is not None and scheme.activations
    atol = logprob_atol(dtype, quantized_activations)
    fields = compare(
        outputs, references, dtype, tokenizer.decode, atol, allow_near_ties=quantized_activations
    )
    if fields["status"] == "mismatch" and fields["first_difference"] is None and dtype == "float32":
        if reason := _why_not(config, torch.float64):
            return replace(result, **{**fields, "reason": f"{fields['reason']}; no float64 check: {reason}"})
        log("greedy tokens agree but float32 log-probabilities drift: running both in float64")
        outputs = _run_migrated(model_dir, yaml_file, prompts, tokens, "float64", trust_remote_code)
        del model
        model = load_reference_model(Path(config.model_config.model_path), torch.float64, trust_remote_code)
        references = _references(model, outputs, tokens, torch.float64)
        exact = compare(outputs, references, "float64", tokenizer.decode, LOGPROB_ATOL["float64"])
        fields = settled_in_float64(fields, exact)
    return replace(result, **fields)


def _references(model, outputs: list[dict], tokens: int, dtype: torch.dtype) -> list:
    """transformers' greedy answers to the prompts the migrated run answered; in float64 as that run computes it,
    what transformers' code pins to float32 in float64 too."""
    with in_dtype(dtype):
        return [greedy_reference(model, out["prompt_token_ids"], tokens) for out in outputs]


def settled_in_float64(fields: dict, exact: dict) -> dict:
    """float32 log-probabilities drift while the greedy tokens agree (``fields``): the conversion is exact when
    the two runs agree in float64 (``exact``), and the drift is float32 rounding the checkpoint amplifies (a deep
    recurrence of random weights does)."""
    if exact["status"] != "identical":
        return {**fields, "reason": f"{fields['reason']}; in float64 they differ too"}
    return {
        **fields,
        "status": "identical",
        "reason": f"float32 rounding, not the conversion: in float64 the two agree over "
        f"{exact['tokens_compared']} tokens (log-probabilities within {exact['max_logprob_diff']:.2g})",
    }
