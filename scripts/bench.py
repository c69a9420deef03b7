"""Throughput of the runtime against transformers `generate` on the same model, threads and prompts.

    python scripts/bench.py [--model-dir models/smollm2_135m_instruct] [--new-tokens 64] [--batch 1 64]

Prints tokens/s for both and the ratio (runtime / transformers) per batch size; batches mix prompt
lengths. Targets (a later issue): >= 2x at batch 1, >= 3x at a mixed batch of 64.
"""
import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from runtime.config import InferenceConfig
from runtime.engine.request import SamplingParams
from runtime.offline import OfflineInference

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while", "the", "sun", "sets",
         "behind", "the", "quiet", "hills"]


def prompts(n: int) -> list[str]:
    return [" ".join(WORDS[: 3 + (7 * i) % len(WORDS)] * (1 + i % 3)) for i in range(n)]


def bench_transformers(path: Path, batch: list[str], new_tokens: int, dtype: torch.dtype) -> float:
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    enc = tok(batch, return_tensors="pt", padding=True)
    with torch.inference_mode():
        model.generate(**enc, max_new_tokens=2, do_sample=False)  # warm-up
        start = time.perf_counter()
        model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return len(batch) * new_tokens / (time.perf_counter() - start)


def bench_runtime(model_dir: Path, batch: list[str], new_tokens: int) -> tuple[float, InferenceConfig]:
    config = InferenceConfig.from_yaml(model_dir / "config" / f"{model_dir.name}.yaml")
    config.scheduler_config.batch_size = len(batch)
    config.scheduler_config.max_new_tokens = new_tokens
    llm = OfflineInference(config, model_dir)
    sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(batch, sampling, chat=False)
    return len(batch) * new_tokens / (time.perf_counter() - start), config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("models/smollm2_135m_instruct"))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    args = parser.parse_args()
    print(f"threads: {torch.get_num_threads()}")
    for n in args.batch:
        batch = prompts(n)
        ours, config = bench_runtime(args.model_dir, batch, args.new_tokens)
        theirs = bench_transformers(Path(config.model_config.model_path), batch, args.new_tokens,
                                    config.model_config.torch_dtype)
        print(f"batch {n:3d}: runtime {ours:8.1f} tok/s   transformers {theirs:8.1f} tok/s   ratio {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
