"""Prefill-decode disaggregation on one host: a router in front of two prefill instances (W=1 and TP 2, whose
KV is re-sharded by head on the way) and one decode instance (W=1) answers exactly as the offline run; a prefill
error comes back at once; a request whose KV never comes fails with 503 within the timeout and leaks no block;
a killed decode instance gives 503 at once."""

import os
import signal
import time
from contextlib import ExitStack
from types import SimpleNamespace

import httpx
import pytest
from hf_reference import NEW_TOKENS
from serve_harness import served_texts, serving
from tiny_checkpoint import PARITY_PROMPTS

from runtime.launch import free_port

KV_TIMEOUT = "3"


def _router(logs, prefills, decode):
    """A router in front of the prefill instances and the decode instance (a context manager, as `serving`)."""
    backends = [a for p in prefills for a in ("--prefill", p.url)] + ["--decode", decode.url]
    return serving(None, logs / "router.log", "--pd-role", "router", *backends)


@pytest.fixture(scope="module")
def pd(served_llama, tmp_path_factory):
    model_dir, yamls, offline = served_llama
    logs = tmp_path_factory.mktemp("pd_logs")
    bootstrap = str(free_port())  # the W=1 prefill's; the router names each prefill to the decode side
    pd_args = ["--kv-timeout", KV_TIMEOUT, "--max-model-len", "4000"]
    with ExitStack() as stack:
        p1 = stack.enter_context(
            serving(
                model_dir,
                logs / "prefill1.log",
                "--pd-role",
                "prefill",
                *pd_args,
                "--bootstrap-port",
                bootstrap,
            )
        )
        p2 = stack.enter_context(
            serving(
                model_dir,
                logs / "prefill2.log",
                "--pd-role",
                "prefill",
                *pd_args,
                "--bootstrap-port",
                str(free_port()),
                "--yaml",
                str(yamls["tp2"]),
            )
        )
        decode = stack.enter_context(
            serving(
                model_dir, logs / "decode.log", "--pd-role", "decode", *pd_args, "--bootstrap-port", bootstrap
            )
        )
        router = stack.enter_context(_router(logs, [p1, p2], decode))
        yield SimpleNamespace(prefills=[p1, p2], decode=decode, router=router, offline=offline)


def test_pd_equals_offline(pd):
    for _ in range(2):  # 24 requests: both prefill instances get some (all on one: p = 2 ** -23)
        assert (
            served_texts(pd.router.url, "default", NEW_TOKENS) == pd.offline["raw"] * 2 + pd.offline["chat"]
        )
    requests = 2 * 3 * len(PARITY_PROMPTS)
    prefill = [p.wait_idle() for p in pd.prefills]
    decode = pd.decode.wait_idle()
    assert all(m["skill_kv_cache_used_blocks"] == 0 for m in [*prefill, decode])
    firsts = [m["skill_generation_tokens_total"] for m in prefill]
    assert sum(firsts) == requests and min(firsts) > 0  # the first token only, on both; decode did the rest
    assert decode["skill_generation_tokens_total"] > requests


def test_lost_kv_bad_requests_and_a_dead_decode_instance(pd):
    decode, router = pd.decode, pd.router
    body = {"model": "default", "prompt": "The capital of", "max_tokens": 4, "bootstrap_room": 12345}
    start = time.monotonic()
    r = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=30)  # no prefill ever sends its KV
    assert r.status_code == 503 and "did not arrive" in r.json()["error"]["message"]
    assert time.monotonic() - start < float(KV_TIMEOUT) + 5
    assert decode.wait_idle()["skill_kv_cache_used_blocks"] == 0
    routed = {**body, "bootstrap_room": None}
    no_room = httpx.post(f"{decode.url}/v1/completions", json=routed, timeout=30)
    assert no_room.status_code == 400 and no_room.json()["error"]["param"] == "bootstrap_room"
    bad = httpx.post(f"{router.url}/v1/completions", json={**routed, "n": 2}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
    before = decode.metrics()["skill_generation_tokens_total"]
    with pytest.raises(
        httpx.ReadTimeout
    ):  # a non-streamed client that gives up: the router drops both halves
        httpx.post(
            f"{router.url}/v1/completions",
            json={**routed, "max_tokens": 3900, "ignore_eos": True},
            timeout=1.0,
        )
    m = decode.wait_idle()
    assert m["skill_kv_cache_used_blocks"] == 0 and m["skill_generation_tokens_total"] - before < 3900
    os.kill(decode.proc.pid, signal.SIGKILL)
    decode.proc.wait(30)
    start = time.monotonic()
    r = httpx.post(f"{router.url}/v1/completions", json=routed, timeout=30)
    assert r.status_code == 503 and "decode instance" in r.json()["error"]["message"]
    assert time.monotonic() - start < 10
    assert httpx.get(f"{router.url}/health", timeout=30).status_code == 503
    assert all(p.wait_idle()["skill_kv_cache_used_blocks"] == 0 for p in pd.prefills)


@pytest.mark.slow  # a migration and three servers: the state hand-over's own mechanics are unit-tested
def test_a_hybrid_s_layer_states_go_with_its_kv(tmp_path_factory):
    """LFM2's short convolutions keep a window per request: the prefill instance sends it with the prompt's KV,
    and the decode instance goes on from it, answering as the offline run."""
    from hf_reference import build_reference, migrate
    from serve_harness import offline_outputs

    model_dir = migrate(build_reference("lfm2", tmp_path_factory), tmp_path_factory.mktemp("lfm2") / "models")
    offline = [
        o["text"]
        for flags in (["--raw"], [])
        for o in offline_outputs(model_dir, PARITY_PROMPTS, NEW_TOKENS, *flags)
    ]
    logs, bootstrap = tmp_path_factory.mktemp("pd_hybrid_logs"), str(free_port())
    pd_args = ["--kv-timeout", "30", "--bootstrap-port", bootstrap]
    with ExitStack() as stack:
        prefill = stack.enter_context(
            serving(model_dir, logs / "prefill.log", "--pd-role", "prefill", *pd_args)
        )
        decode = stack.enter_context(serving(model_dir, logs / "decode.log", "--pd-role", "decode", *pd_args))
        router = stack.enter_context(_router(logs, [prefill], decode))
        n = len(PARITY_PROMPTS)
        assert served_texts(router.url, "default", NEW_TOKENS) == offline[:n] * 2 + offline[n:]
        assert decode.wait_idle()["skill_generation_tokens_total"] > 3 * n
