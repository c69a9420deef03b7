"""Scheduler state machine on a real KVCacheManager / LegacyCacheRows, fed synthetic next tokens (no model)."""

import pytest
import torch

from runtime.engine.legacy_cache import LegacyCacheRows
from runtime.engine.request import Batch, Request, SamplingParams, Status
from runtime.engine.scheduler import Scheduler, SlotAllocator
from runtime.errors import UserError
from runtime.kv_cache import CacheEntry, KVCacheManager, ModelCacheInfo

EOS = 2
BLOCK = 4
INFO = ModelCacheInfo([CacheEntry("l0", 2, 4, torch.float32)])


def paged(num_blocks: int = 64) -> KVCacheManager:
    return KVCacheManager(INFO, num_blocks, BLOCK)


def free_blocks(kv: KVCacheManager) -> int:
    (n,) = kv.num_free_blocks().values()
    return n


def req(prompt_len: int, max_new: int = 32, **params) -> Request:
    return Request(list(range(10, 10 + prompt_len)), SamplingParams(max_new_tokens=max_new, **params))


def sched(kv: SlotAllocator, *requests: Request, max_batch: int = 8, budget: int = 0) -> Scheduler:
    s = Scheduler(kv, max_batch, budget, eos_token_ids=(EOS,))
    for r in requests:
        s.add_request(r)
    return s


def synthetic(r: Request) -> int:
    """The token for position num_tokens: a function of the position only, never EOS, so recomputation after a
    preemption must reproduce exactly the same outputs."""
    return 100 + r.num_tokens


def feed(s: Scheduler, batch: Batch | None) -> Batch:
    assert batch is not None, "scheduler has work but scheduled nothing"
    s.process_batch_output(batch, [synthetic(r) for r in batch.requests])
    for r in batch.requests:
        assert r.computed_len == r.num_tokens - 1, (r.computed_len, r.num_tokens)
    return batch


def step(s: Scheduler) -> Batch:
    return feed(s, s.schedule())


def drain(s: Scheduler, max_steps: int = 500) -> list[Batch]:
    batches: list[Batch] = []
    while s.has_work():
        assert len(batches) < max_steps
        batches.append(step(s))
    return batches


def expected_outputs(r: Request) -> list[int]:
    p = len(r.prompt_token_ids)
    return [100 + p + i for i in range(r.sampling.max_new_tokens)]


def test_prefill_admits_waiting_up_to_max_batch_then_decodes_all_running():
    kv = paged()
    reqs = [req(5, max_new=3) for _ in range(5)]
    s = sched(kv, *reqs, max_batch=3)
    batch = s.schedule()
    assert batch is not None and batch.is_prefill and batch.requests == reqs[:3]
    assert batch.new_token_ids() == [r.prompt_token_ids for r in reqs[:3]]
    assert [r.status for r in reqs] == [Status.RUNNING] * 3 + [Status.WAITING] * 2
    assert s.running == reqs[:3] and list(s.waiting) == reqs[3:]
    feed(s, batch)
    assert [r.computed_len for r in reqs[:3]] == [5] * 3

    batch = s.schedule()  # batch full: no prefill
    assert batch is not None and not batch.is_prefill and batch.requests == reqs[:3]
    assert batch.new_token_ids() == [[105]] * 3
    feed(s, batch)
    assert [r.computed_len for r in reqs[:3]] == [6] * 3

    drain(s)
    assert all(r.finish_reason == "length" and r.output_token_ids == expected_outputs(r) for r in reqs)
    assert free_blocks(kv) == 63


def test_new_request_is_prefilled_before_the_next_decode_step():
    s = sched(paged(), a := req(3), b := req(6))
    assert step(s).is_prefill
    assert step(s).requests == [a, b]
    s.add_request(c := req(4))
    batch = step(s)
    assert batch.is_prefill and batch.requests == [c]
    batch = step(s)
    assert not batch.is_prefill and batch.requests == [a, b, c]
    assert [r.computed_len for r in (a, b, c)] == [5, 8, 5]


def test_prefill_token_budget_splits_batches_but_always_admits_one():
    reqs = [req(n, max_new=2) for n in (3, 4, 5, 20)]
    s = sched(paged(), *reqs, budget=8)
    prefills = [step(s) for _ in range(3)]
    assert all(b.is_prefill for b in prefills)
    assert [b.requests for b in prefills] == [reqs[:2], reqs[2:3], reqs[3:]]  # 7, 5, 20 (> budget, alone)
    batch = step(s)
    assert not batch.is_prefill and batch.requests == reqs


@pytest.mark.parametrize(
    "params, tokens, reason",
    [
        ({}, [5, EOS], "stop"),
        ({"stop_token_ids": (9,)}, [5, 9], "stop"),
        ({"stop_token_ids": (9,), "ignore_eos": True}, [EOS, 9], "stop"),
        ({"max_new_tokens": 3}, [5, 6, 7], "length"),
        ({"max_new_tokens": 3, "ignore_eos": True}, [EOS, EOS, EOS], "length"),
        ({"max_new_tokens": 1}, [EOS], "stop"),
    ],
    ids=["eos", "stop_token", "stop_token_ignore_eos", "max_new_tokens", "ignore_eos", "eos_beats_length"],
)
def test_finish_reasons_and_kv_release(params: dict, tokens: list[int], reason: str):
    kv = paged(8)
    r = Request([10, 11, 12, 13, 14], SamplingParams(**params))
    s = sched(kv, r)
    for i, tok in enumerate(tokens):
        batch = s.schedule()
        assert batch is not None and batch.is_prefill == (i == 0)
        done = s.process_batch_output(batch, [tok])
        assert done == ([r] if i == len(tokens) - 1 else [])
    assert r.status is Status.FINISHED and r.is_finished and r.finish_reason == reason
    assert r.output_token_ids == tokens
    assert not s.has_work() and s.schedule() is None
    assert not kv.has_request(r.request_id) and free_blocks(kv) == 7


def test_admission_waits_for_free_blocks():
    kv = paged(3)  # 2 usable blocks = 8 tokens
    s = sched(kv, a := req(4, max_new=2), b := req(8, max_new=1))
    batch = step(s)
    assert batch.requests == [a] and b.status is Status.WAITING and list(s.waiting) == [b]
    batch = step(s)  # b still does not fit: a decodes (taking the last block) and finishes
    assert not batch.is_prefill and batch.requests == [a] and a.finish_reason == "length"
    batch = step(s)
    assert batch.is_prefill and batch.requests == [b] and b.is_finished
    assert free_blocks(kv) == 2


def test_preemption_evicts_newest_and_recomputes_it_from_prompt_plus_outputs():
    kv = paged(7)  # 6 usable blocks; a, b, c take 2 each once they pass 4 tokens
    a, b, c, d = req(4, max_new=6), req(4, max_new=8), req(4, max_new=8), req(4, max_new=2)
    s = sched(kv, a, b, c, d, max_batch=3)
    while not c.num_preemptions:
        batch = step(s)
    # a needed a 3rd block at 9 tokens: c gave its 2 back, a and b took one each
    assert not batch.is_prefill and batch.requests == [a, b]
    assert (c.status, c.computed_len, c.num_preemptions) == (Status.WAITING, 0, 1)
    assert list(s.waiting) == [c, d] and s.running == [b]  # a finished in that step
    assert a.finish_reason == "length" and (a.num_preemptions, b.num_preemptions) == (0, 0)
    outputs_so_far = list(c.output_token_ids)
    assert len(outputs_so_far) == 5

    batch = s.schedule()
    assert batch is not None and batch.is_prefill and batch.requests == [c]
    assert batch.new_token_ids() == [c.prompt_token_ids + outputs_so_far]
    feed(s, batch)
    assert c.computed_len == 9 and c.output_token_ids[:5] == outputs_so_far

    drain(s)
    assert all(r.output_token_ids == expected_outputs(r) for r in (a, b, c, d))
    assert free_blocks(kv) == 6 and not s.running and not s.waiting


def test_many_requests_under_kv_pressure_all_finish_with_consistent_outputs():
    kv = paged(9)
    reqs = [req(n, max_new=m) for n, m in [(3, 9), (7, 5), (2, 12), (5, 6), (1, 10), (6, 3)]]
    s = sched(kv, *reqs, max_batch=4, budget=10)
    drain(s)
    assert sum(r.num_preemptions for r in reqs) > 0
    assert all(r.finish_reason == "length" and r.output_token_ids == expected_outputs(r) for r in reqs)
    assert all(r.is_finished for r in reqs) and not s.has_work()
    assert free_blocks(kv) == 8


def test_prompt_larger_than_whole_cache_raises_user_error():
    s = sched(paged(3), req(9))
    with pytest.raises(UserError, match="num_kv_blocks"):
        s.schedule()


def test_request_outgrowing_whole_cache_raises_user_error():
    s = sched(paged(3), req(8, max_new=4))  # prompt fills both blocks, the first decode needs a third
    with pytest.raises(UserError, match="num_kv_blocks"):
        drain(s)


def test_legacy_rows_limit_running_requests():
    kv = LegacyCacheRows(num_rows=2, max_seq_len=16)
    reqs = [req(4, max_new=m) for m in (2, 3, 2)]
    s = sched(kv, *reqs, max_batch=4)
    batch = step(s)
    assert batch.is_prefill and batch.requests == reqs[:2] and list(s.waiting) == reqs[2:]
    rows = kv.block_tables([r.request_id for r in reqs[:2]])
    assert sorted(row for (row,) in next(iter(rows.values()))) == [0, 1]
    batch = step(s)
    assert not batch.is_prefill and batch.requests == reqs[:2] and reqs[0].is_finished
    batch = step(s)
    assert batch.is_prefill and batch.requests == reqs[2:]
    drain(s)
    assert all(r.output_token_ids == expected_outputs(r) for r in reqs)
    assert kv.usage_summary().endswith(" 0 rows in use, peak 2 of 2")
    assert kv.stats() == {
        "layout": "legacy",
        "num_blocks": 2,
        "block_size": 16,
        "used_blocks": 0,
        "peak_used_blocks": 2,
    }


@pytest.mark.parametrize("prompt_len, max_new", [(9, 1), (7, 3)], ids=["prompt", "prompt_plus_outputs"])
def test_legacy_rows_reject_sequences_longer_than_max_seq_len(prompt_len: int, max_new: int):
    s = sched(LegacyCacheRows(num_rows=2, max_seq_len=8), req(prompt_len, max_new=max_new))
    with pytest.raises(UserError, match="legacy KV cache rows hold 8"):
        drain(s)


def test_abort_frees_blocks_of_running_and_drops_waiting_requests():
    kv = paged(7)
    a, b, c = req(4, max_new=8), req(4, max_new=8), req(4, max_new=8)
    s = sched(kv, a, b, c, max_batch=2)
    step(s)  # a, b running; c waiting
    assert a.status is Status.RUNNING and c.status is Status.WAITING
    s.abort(a)
    s.abort(c)
    assert (a.finish_reason, c.finish_reason) == ("abort", "abort") and a.is_finished and c.is_finished
    assert not kv.has_request(a.request_id) and s.running == [b] and not s.waiting
    s.abort(a)  # finished already: nothing happens
    drain(s)
    assert b.finish_reason == "length" and free_blocks(kv) == 6
