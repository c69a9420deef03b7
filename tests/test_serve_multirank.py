"""Multi-rank `skill serve`: TP 2 (requests broadcast over tp_cpu_group) and attention DP 2 with TP'd dense
layers (two DP leaders in lock-step over dp_leader_group) answer exactly as the single-rank server and the
offline run do, for concurrent clients."""
import asyncio
import json
from pathlib import Path

import openai
import pytest
from hf_reference import NEW_TOKENS, build_reference, migrate, parallel_yaml, parallelize
from serve_harness import offline_outputs, serving
from tiny_checkpoint import PARITY_PROMPTS

# (world_size, attn_tp, dense_tp, embed_tp, lmhead_tp)
LAYOUTS = {"tp2": (2, 2, 2, 2, 2), "attn_dp2": (2, 1, 2, 2, 2)}


@pytest.fixture(scope="module")
def served_model(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    reference = build_reference("llama", tmp_path_factory)
    root = tmp_path_factory.mktemp("serve_mr")
    model_dir = migrate(reference, root / "models")
    yamls = {}
    for name, sizes in LAYOUTS.items():
        proc = parallelize(model_dir, parallel_yaml(root / f"{name}.yaml", *sizes), "--json")
        assert proc.returncode == 0, proc.stderr[-3000:]
        yamls[name] = Path(json.loads(proc.stdout)["yaml"])
    return model_dir, yamls


def served_texts(url: str, model: str) -> list[str]:
    """The prompts twice over, all at once: streamed completions, then chat."""
    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

        async def complete(prompt: str) -> str:
            stream = await client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS,
                                                     temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in stream])

        async def chat(prompt: str) -> str:
            r = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                     max_tokens=NEW_TOKENS, temperature=0)
            return r.choices[0].message.content

        jobs = [complete(p) for p in PARITY_PROMPTS * 2] + [chat(p) for p in PARITY_PROMPTS]
        return await asyncio.wait_for(asyncio.gather(*jobs), 240)

    return asyncio.run(main())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_multi_rank_serve_equals_single_rank(served_model, layout, tmp_path):
    model_dir, yamls = served_model
    raw = [o["text"] for o in offline_outputs(model_dir, PARITY_PROMPTS, NEW_TOKENS, "--raw")]
    chat = [o["text"] for o in offline_outputs(model_dir, PARITY_PROMPTS, NEW_TOKENS)]
    with serving(model_dir, tmp_path / "serve.log", "--yaml", str(yamls[layout])) as server:
        texts = served_texts(server.url, "default")
        m = server.wait_idle()
        assert server.stop() == 0
    assert texts == raw * 2 + chat
    assert m["skill_kv_cache_used_blocks"] == 0 and m["skill_kv_cache_total_blocks"] > 0
