"""Decode time per step of multi-head latent attention, absorbed against decompressed, by context length.

    .venv/bin/python scripts/latent_decode.py [--contexts 128 1024 3072] [--threads 2]

Builds a DeepSeek-V3-shaped model of random bfloat16 weights (132M parameters: 4 dense layers, 16 heads,
kv_lora_rank 512, rope 64, nope 128, values 128) in a temporary directory, `skill migrate`s it (which checks its
greedy tokens against transformers), then times single-request decode steps on one engine at each context
length, both ways on the same weights, alternated twice: absorbed (the maps the layers read off the expansion
at the engine's start-up probe) and decompressed (every step expands each cached latent into per-head keys and
values).
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from tiny_checkpoint import make_tokenizer

from runtime.engine.request import SamplingParams
from runtime.layers.attention import Attention
from skills.bench.engines import Ours, bench_config

STEPS = 30


def build(out: Path) -> None:
    config = DeepseekV3Config(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        first_k_dense_replace=4,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    make_tokenizer(out, config.vocab_size)


def step_ms(engine, prompt: list[int]) -> float:
    """Mean wall time of STEPS decode steps of one request with this prompt (after its prefill and a step)."""
    engine.add_request(prompt, SamplingParams(max_new_tokens=STEPS + 3, ignore_eos=True))
    engine.step()  # prefill
    engine.step()
    start = time.perf_counter()
    for _ in range(STEPS):
        engine.step()
    elapsed = (time.perf_counter() - start) / STEPS * 1e3
    while engine.has_unfinished():
        engine.step()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 3072])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with tempfile.TemporaryDirectory(prefix="latent-decode-") as tmp:
        build(Path(tmp) / "checkpoint")
        migrate = [
            sys.executable,
            "-m",
            "skills.cli",
            "migrate",
            f"{tmp}/checkpoint",
            "--out",
            tmp,
            "--name",
            "mla",
        ]
        subprocess.run(migrate, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        model_dir = Path(tmp) / "mla"
        config = bench_config(
            model_dir / "config/mla.yaml", "bfloat16", None, 1, max(args.contexts), STEPS + 3
        )
        ours = Ours(model_dir, config)
        layers = [m for m in ours.engine.worker.model.modules() if isinstance(m, Attention) and m.latent_dim]
        assert all(m.latent_linear for m in layers), "the latent expansion was not found linear"
        for context in args.contexts:
            prompt = [(7 * i) % 1000 + 3 for i in range(context)]
            times = {"absorbed": [], "decompressed": []}
            for mode in [*times] * 2:
                for layer in layers:
                    layer.latent_linear = mode == "absorbed"
                times[mode].append(step_ms(ours.engine, prompt))
            a, d = (min(t) for t in times.values())
            print(
                f"context {context:5d}: absorbed {a:6.1f} ms/step, decompressed {d:6.1f} ms/step ({d / a:.1f}x)"
            )


if __name__ == "__main__":
    main()
