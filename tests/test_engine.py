"""The persistent engine API: add_request / step / abort / has_unfinished on one long-lived ExecutionEngine."""

import pytest
from model_dirs import make_model_dir
from tiny_checkpoint import PARITY_PROMPTS
from transformers import AutoTokenizer

from runtime.config import InferenceConfig
from runtime.engine.request import SamplingParams
from runtime.engine.step_stats import PhaseTimes
from runtime.offline import OfflineInference

NEW = 8


@pytest.fixture(scope="module")
def llm(tmp_path_factory, tiny_llama_dir) -> OfflineInference:
    model_dir = make_model_dir(tmp_path_factory.mktemp("engine"), tiny_llama_dir, batch_size=4)
    return OfflineInference(
        InferenceConfig.from_yaml(model_dir / "config" / f"{model_dir.name}.yaml"), model_dir
    )


@pytest.fixture(scope="module")
def prompt_ids(tiny_llama_dir) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    return [tok(p)["input_ids"] for p in PARITY_PROMPTS]


def greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def test_streamed_steps_equal_generate_and_leave_the_pool_empty(llm, prompt_ids):
    expected = [o.token_ids for o in llm.generate_ids(prompt_ids, [greedy()] * len(prompt_ids))]
    engine = llm.engine
    ids = [engine.add_request(p, greedy()) for p in prompt_ids]
    streamed: dict[int, list[int]] = {i: [] for i in ids}
    finished = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        assert steps < 100
        for out in engine.step():
            assert out.request_id not in finished and len(out.new_token_ids) == 1
            streamed[out.request_id] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert [streamed[i] for i in ids] == expected
    assert finished == dict.fromkeys(ids, "length")
    assert steps == NEW  # one prefill of all four, then one decode step per token: no per-call rebuild
    assert engine.kv.num_free_blocks() == {"full": engine.kv.stats()["num_blocks"]}
    assert len(engine.states) == 0  # per-request layer states go with their requests (warm-up's too)


def test_abort_frees_blocks_at_once_and_the_others_finish(llm, prompt_ids):
    engine = llm.engine
    free = engine.kv.num_free_blocks()
    keep, drop = engine.add_request(prompt_ids[0], greedy()), engine.add_request(prompt_ids[3], greedy(20))
    engine.step()
    assert engine.kv.has_request(drop)
    assert engine.abort(drop) and not engine.kv.has_request(drop) and not engine.abort(drop)
    waiting = engine.add_request(prompt_ids[1], greedy())
    assert engine.abort(waiting)  # never scheduled
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert {o.request_id for o in outs} == {keep} and outs[-1].finish_reason == "length"
    assert engine.kv.num_free_blocks() == free and len(engine.states) == 0


def test_one_batch_mixes_sampling_parameters(llm, prompt_ids):
    """Greedy, seeded sampling and a stop token side by side; each request keeps its own parameters."""
    base = llm.generate_ids(prompt_ids[:1], [greedy()])[0].token_ids
    seeded = SamplingParams(max_new_tokens=NEW, temperature=1.0, top_k=20, seed=7, ignore_eos=True)
    stop = SamplingParams(max_new_tokens=NEW, stop_token_ids=(base[2],), ignore_eos=True)
    first = llm.generate_ids([prompt_ids[0]] * 3, [greedy(), seeded, stop])
    again = llm.generate_ids([prompt_ids[0]] * 2, [seeded, greedy(3)])
    assert first[0].token_ids == base and first[0].finish_reason == "length"
    assert first[1].token_ids == again[0].token_ids  # same seed, same draws, whatever the batch
    assert first[2].token_ids == base[:3] and first[2].finish_reason == "stop"
    assert again[1].token_ids == base[:3]


def test_add_request_rejects_an_empty_prompt(llm):
    with pytest.raises(ValueError, match="prompt token"):
        llm.engine.add_request([], greedy())


def test_profiler_writes_traces_of_the_first_prefill_and_decode_steps(tmp_path, tiny_llama_dir, prompt_ids):
    model_dir = make_model_dir(tmp_path, tiny_llama_dir)
    config = InferenceConfig.from_yaml(model_dir / "config" / f"{model_dir.name}.yaml")
    config.model_config.enable_profiler = True
    llm = OfflineInference(config, model_dir)
    llm.generate_ids(prompt_ids[:2], [greedy()] * 2)
    prefill = sorted((model_dir / "prof" / "prefill").glob("*.json"))
    decode = sorted((model_dir / "prof" / "decode").glob("*.json"))
    assert len(prefill) == 1 and len(decode) == 3
    assert all('"traceEvents"' in p.read_text() for p in prefill + decode)


def test_phase_times_keep_constant_memory_and_skip_the_cold_step():
    times = PhaseTimes()
    assert times.mean() == 0.0 and times.mean(skip_first=True) == 0.0
    for ms in (90.0, 10.0, 20.0):
        times.add(ms)
    assert times.mean() == 40.0 and times.mean(skip_first=True) == 15.0
