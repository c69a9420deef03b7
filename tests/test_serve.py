"""`skill serve` on a tiny random checkpoint through the official openai client: greedy answers equal the
offline `skill run`, streamed or not, under concurrency; errors get OpenAI's statuses; dropped clients free
their KV blocks; SIGTERM lets in-flight requests finish and exits 0. Loopback only, every wait bounded."""

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from model_dirs import make_model_dir
from serve_harness import offline_outputs, serving
from skill_process import process_gone
from tiny_checkpoint import PARITY_PROMPTS

KEY = "test-key"
MODEL = "contract_llama"
NEW = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_llama_dir) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("serve"), tiny_llama_dir, batch_size=8)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with serving(
        model_dir, tmp_path_factory.mktemp("log") / "serve.log", "--api-key", KEY, "--max-queue", "64"
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline_raw(model_dir) -> list[dict]:
    return offline_outputs(model_dir, PARITY_PROMPTS, NEW, "--raw")


@pytest.fixture(scope="module")
def offline_chat(model_dir) -> list[dict]:
    return offline_outputs(model_dir, PARITY_PROMPTS, NEW)


def test_completions_equal_offline_streamed_or_not(client, offline_raw):
    for prompt, ref in zip(PARITY_PROMPTS, offline_raw, strict=True):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (ref["text"], ref["finish_reason"])
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (
            len(ref["prompt_token_ids"]),
            len(ref["token_ids"]),
        )
        by_ids = client.completions.create(
            model=MODEL,
            prompt=ref["prompt_token_ids"],
            max_tokens=NEW,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        assert by_ids.choices[0].text == ref["text"] and by_ids.choices[0].token_ids == ref["token_ids"]
        chunks = list(
            client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=NEW,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref["text"]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref["finish_reason"]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref["token_ids"])


def test_list_prompt_gives_one_choice_per_prompt(client, offline_raw):
    r = client.completions.create(model=MODEL, prompt=PARITY_PROMPTS, max_tokens=NEW, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [o["text"] for o in offline_raw]
    assert r.usage.completion_tokens == sum(len(o["token_ids"]) for o in offline_raw)


def test_chat_equals_offline_streamed_or_not(client, offline_chat):
    for prompt, ref in zip(PARITY_PROMPTS, offline_chat, strict=True):
        messages = [{"role": "user", "content": prompt}]
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0)
        assert (
            r.choices[0].message.content == ref["text"] and r.choices[0].finish_reason == ref["finish_reason"]
        )
        assert r.usage.prompt_tokens == len(ref["prompt_token_ids"])
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=NEW, temperature=0, stream=True
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref["text"]
        ids = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=NEW,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True},
        )
        assert [t for c in ids for t in (c.choices[0].model_extra or {}).get("token_ids", [])] == ref[
            "token_ids"
        ]
        assert chunks[-1].choices[0].finish_reason == ref["finish_reason"]


def test_logprobs_when_asked(client, offline_raw):
    r = client.completions.create(
        model=MODEL, prompt=PARITY_PROMPTS[1], max_tokens=NEW, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert r.choices[0].text == offline_raw[1]["text"]
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert (
            len(top) <= 3 and chosen <= 0 and chosen == pytest.approx(max(top.values()))
        )  # greedy: the top one
    assert sum(2.718281828**v for v in lp.top_logprobs[0].values()) <= 1 + 1e-5
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(
        len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content
    )
    plain = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_concurrent_clients_equal_offline_and_free_every_block(server, offline_raw):
    async def main() -> tuple[list[str], list[str]]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)

        async def streamed(prompt: str) -> str:
            stream = await aclient.completions.create(
                model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0, stream=True
            )
            return "".join([c.choices[0].text async for c in stream])

        async def whole(prompt: str) -> str:
            r = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0)
            return r.choices[0].text

        prompts = [PARITY_PROMPTS[i % len(PARITY_PROMPTS)] for i in range(64)]
        first = await asyncio.wait_for(asyncio.gather(*(streamed(p) for p in prompts[:32])), 180)
        second = await asyncio.wait_for(asyncio.gather(*(whole(p) for p in prompts)), 180)
        return first, second

    streamed, whole = asyncio.run(main())
    expected = [offline_raw[i % len(offline_raw)]["text"] for i in range(64)]
    assert streamed == expected[:32] and whole == expected
    m = server.wait_idle()
    assert m["skill_kv_cache_used_blocks"] == 0 and m["skill_kv_cache_total_blocks"] > 0
    assert m["skill_num_requests_running"] == m["skill_num_requests_waiting"] == 0
    assert m["skill_time_to_first_token_seconds_count"] >= 96 and m["skill_generation_tokens_total"] >= 96


def _post(server, path: str, body=None, key: str | None = KEY, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60, **kw)


def _error(r: httpx.Response, status: int, param: str | None = None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err["message"]


def test_errors_get_openai_statuses_and_the_server_keeps_serving(server):
    ok = {"model": MODEL, "prompt": "The capital of", "max_tokens": 2}
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(f"{server.url}/v1/completions", content=b'{"model": "x", ', headers=headers, timeout=30)
    assert "not valid JSON" in _error(r, 400, "body")
    _error(_post(server, "/v1/completions", {**ok, "max_tokens": -1}), 400, "max_tokens")
    _error(_post(server, "/v1/completions", {**ok, "temperature": "hot"}), 400, "temperature")
    _error(_post(server, "/v1/completions", {**ok, "n": 2}), 400, "n")
    _error(_post(server, "/v1/completions", {**ok, "seed": 2**70}), 400, "seed")  # never reaches the engine
    _error(_post(server, "/v1/completions", {"model": MODEL}), 400, "prompt")
    _error(_post(server, "/v1/chat/completions", {"model": MODEL, "messages": []}), 400, "messages")
    _error(_post(server, "/v1/completions", {**ok, "prompt": [10**9]}), 400, "prompt")
    limit = 64 + 16  # input_truncated_len + max_new_tokens of the YAML
    msg = _error(
        _post(server, "/v1/completions", {**ok, "prompt": [5] * 70, "max_tokens": 20}), 400, "max_tokens"
    )
    assert all(str(n) in msg for n in (limit, 70, 20))
    assert "does not exist" in _error(_post(server, "/v1/completions", {**ok, "model": "nope"}), 404, "model")
    _error(_post(server, "/v1/completions", ok, key=None), 401)
    _error(_post(server, "/v1/completions", ok, key="wrong"), 401)
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
    models = httpx.get(
        f"{server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10
    ).json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == limit
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # open without a key
    assert _post(server, "/v1/completions", ok).status_code == 200


def _descendants(pid: int) -> list[int]:
    children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return children + [d for c in children for d in _descendants(c)]


@pytest.fixture()
def small_server(model_dir, tmp_path):
    with serving(
        model_dir,
        tmp_path / "serve.log",
        "--max-queue",
        "0",
        "--max-model-len",
        "4000",
        "--grace-period",
        "20",
    ) as s:
        yield s


def test_full_queue_dropped_clients_and_sigterm(small_server):
    server = small_server
    long = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True}

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as c:
            rs = await asyncio.gather(*(c.post(f"{server.url}/v1/completions", json=long) for _ in range(12)))
        return [r.status_code for r in rs]

    codes = asyncio.run(burst())
    assert codes.count(429) >= 4 and set(codes) == {200, 429}, codes  # batch_size 8, no queue
    assert server.wait_idle()["skill_kv_cache_used_blocks"] == 0

    before = server.metrics()["skill_generation_tokens_total"]
    longer = {**long, "max_tokens": 3900}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**longer, "stream": True}, timeout=60
    ) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # the client goes away after the first chunk
    with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up
        httpx.post(f"{server.url}/v1/completions", json=longer, timeout=0.5)
    m = server.wait_idle()
    assert m["skill_kv_cache_used_blocks"] == 0 and m["skill_num_requests_running"] == 0
    assert m["skill_generation_tokens_total"] - before < 2 * 3900  # both stopped early
    assert m["skill_request_success_total"] >= 2  # counted (as abort)

    done: list[str] = []

    def finish_during_shutdown() -> None:
        with httpx.stream(
            "POST",
            f"{server.url}/v1/completions",
            json={**long, "max_tokens": 60, "stream": True},
            timeout=60,
        ) as r:
            done.extend(r.iter_lines())

    workers = _descendants(server.proc.pid)  # the launcher the server forked and the rank it forked
    assert len(workers) == 2 and "1 engine worker(s), forked by launcher" in server.log.read_text()
    t = threading.Thread(target=finish_during_shutdown)
    t.start()
    deadline = time.monotonic() + 30
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)
    server.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert "data: [DONE]" in done and '"finish_reason": "length"' in "".join(done)
    assert server.stop() == 0
    assert all(process_gone(pid) for pid in workers)


def test_dead_workers_give_503(small_server):
    server = small_server
    for pid in _descendants(server.proc.pid):  # the launcher and its rank
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while httpx.get(f"{server.url}/health", timeout=10).status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}, key=None)
    _error(r, 503)
