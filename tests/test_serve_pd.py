"""Prefill-decode disaggregation on one host: a router, a prefill instance (W=1, then TP 2: KV re-sharded by
head on the way) and a decode instance (W=1) answer exactly as the offline run; a request whose KV never
comes fails with 503 within the timeout and leaks no block; a killed decode instance gives 503 at once."""
import os
import signal
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from hf_reference import NEW_TOKENS
from serve_harness import migrated_with_layouts, offline_outputs, served_texts, serving
from tiny_checkpoint import PARITY_PROMPTS

from runtime.launch import free_port

KV_TIMEOUT = "3"


@pytest.fixture(scope="module")
def served_model(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    return migrated_with_layouts(tmp_path_factory, {"tp2": (2, 2, 2, 2, 2)})


def pd_deployment(stack: ExitStack, model_dir: Path, logs: Path, prefill_yaml: Path | None):
    bootstrap = str(free_port())
    pd = ["--bootstrap-port", bootstrap, "--kv-timeout", KV_TIMEOUT]
    prefill = stack.enter_context(serving(model_dir, logs / "prefill.log", "--pd-role", "prefill", *pd,
                                          *(["--yaml", str(prefill_yaml)] if prefill_yaml else [])))
    decode = stack.enter_context(serving(model_dir, logs / "decode.log", "--pd-role", "decode", *pd))
    router = stack.enter_context(serving(None, logs / "router.log", "--pd-role", "router", "--prefill",
                                         prefill.url, "--decode", decode.url))
    return prefill, decode, router


@pytest.mark.parametrize("prefill_layout", [None, "tp2"])
def test_pd_equals_offline(served_model, prefill_layout, tmp_path):
    model_dir, yamls = served_model
    raw = [o["text"] for o in offline_outputs(model_dir, PARITY_PROMPTS, NEW_TOKENS, "--raw")]
    chat = [o["text"] for o in offline_outputs(model_dir, PARITY_PROMPTS, NEW_TOKENS)]
    with ExitStack() as stack:
        prefill, decode, router = pd_deployment(stack, model_dir, tmp_path,
                                                yamls[prefill_layout] if prefill_layout else None)
        assert served_texts(router.url, "default", NEW_TOKENS) == raw * 2 + chat
        requests = 3 * len(PARITY_PROMPTS)
        p, d = prefill.wait_idle(), decode.wait_idle()
        assert p["skill_kv_cache_used_blocks"] == d["skill_kv_cache_used_blocks"] == 0
        assert p["skill_generation_tokens_total"] == requests  # the first token only; decode did the rest
        assert d["skill_generation_tokens_total"] > requests


def test_lost_kv_and_dead_decode_give_503(served_model, tmp_path):
    model_dir, _ = served_model
    with ExitStack() as stack:
        prefill, decode, router = pd_deployment(stack, model_dir, tmp_path, None)
        body = {"model": "default", "prompt": "The capital of", "max_tokens": 4, "bootstrap_room": 12345}
        start = time.monotonic()
        r = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=30)  # no prefill ever sends its KV
        assert r.status_code == 503 and "did not arrive" in r.json()["error"]["message"]
        assert time.monotonic() - start < float(KV_TIMEOUT) + 5
        assert decode.wait_idle()["skill_kv_cache_used_blocks"] == 0
        no_room = httpx.post(f"{decode.url}/v1/completions", json={**body, "bootstrap_room": None}, timeout=30)
        assert no_room.status_code == 400 and no_room.json()["error"]["param"] == "bootstrap_room"
        os.kill(decode.proc.pid, signal.SIGKILL)
        decode.proc.wait(30)
        start = time.monotonic()
        r = httpx.post(f"{router.url}/v1/completions", json={**body, "bootstrap_room": None}, timeout=30)
        assert r.status_code == 503 and "decode instance" in r.json()["error"]["message"]
        assert time.monotonic() - start < 10
        assert httpx.get(f"{router.url}/health", timeout=30).status_code == 503
        assert prefill.wait_idle()["skill_kv_cache_used_blocks"] == 0
