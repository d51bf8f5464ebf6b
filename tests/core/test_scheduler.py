"""Scheduler unit tests: token budget, max_num_seqs, FCFS, chunked prefill, preemption, abort, stops."""
from __future__ import annotations

from vllm.config import SchedulerConfig
from vllm.core.kv_cache_manager import KVCacheManager
from vllm.core.request import Request, RequestStatus
from vllm.core.scheduler import Scheduler
from vllm.sampling_params import SamplingParams


def request(rid: str, n_prompt: int, max_tokens: int = 4, **params) -> Request:
    return Request(rid, list(range(10, 10 + n_prompt)), SamplingParams(max_tokens=max_tokens, **params), max_tokens,
                   frozenset({2}))


def make(budget=32, max_seqs=4, blocks=100, slots=4, block_size=4) -> Scheduler:
    kv = KVCacheManager(blocks, block_size, slots, needs_blocks=True, needs_slots=True)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), kv)


def run_step(s: Scheduler, token: int = 7):
    out = s.schedule()
    s.update_from_output(out, {x.request.request_id: [token] for x in out.scheduled if x.samples})
    return out


def test_budget_chunks_long_prompts_and_mixes_decode():
    s = make(budget=16)
    s.add_request(request("a", 5))
    s.add_request(request("b", 30))
    out = run_step(s)
    assert [(x.request.request_id, x.num_tokens, x.is_prefilling, x.samples) for x in out.scheduled] == [
        ("a", 5, True, True), ("b", 11, True, False)]
    out = run_step(s)  # a decodes 1 token, b continues its prompt with the rest of the budget
    assert [(x.request.request_id, x.num_tokens, x.is_prefilling) for x in out.scheduled] == [
        ("a", 1, False), ("b", 15, True)]
    out = run_step(s)
    assert [(x.request.request_id, x.num_tokens, x.samples) for x in out.scheduled] == [("a", 1, True),
                                                                                      ("b", 4, True)]


def test_max_num_seqs_and_fcfs():
    s = make(budget=100, max_seqs=2)
    for rid in "abc":
        s.add_request(request(rid, 3))
    out = run_step(s)
    assert [x.request.request_id for x in out.scheduled] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_preemption_frees_and_requeues_the_newest():
    s = make(budget=100, blocks=4, block_size=4, slots=4)  # 16 tokens of cache in all
    s.add_request(request("a", 6, max_tokens=10))
    s.add_request(request("b", 6, max_tokens=10))
    run_step(s)  # a: 2 blocks, b: 2 blocks -> the pool is empty
    assert s.kv.block_pool.num_free == 0
    for _ in range(2):  # a computes its 7th and 8th tokens in its two blocks
        assert run_step(s).preempted_ids == []
    out = run_step(s)  # the 9th needs a third block: b, the newest, is preempted
    assert out.preempted_ids == ["b"] and [x.request.request_id for x in out.scheduled] == ["a"]
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and s.waiting[0] is b
    assert "b" not in s.kv.req_blocks and "b" not in s.kv.req_slots
    assert b.num_tokens == 9  # keeps its generated tokens; it is prefilled again with them


def test_abort_and_stop_free_everything():
    s = make()
    s.add_request(request("a", 5, max_tokens=3))
    s.add_request(request("b", 5, max_tokens=50, stop_token_ids=[9]))
    s.add_request(request("c", 5, max_tokens=50))
    run_step(s)
    s.abort(["c"])
    while s.num_unfinished:
        out = s.schedule()
        s.update_from_output(out, {x.request.request_id: [9] for x in out.scheduled if x.samples})
    s.kv.assert_all_free()


def test_min_tokens_defers_eos_and_stop_ids():
    r = request("a", 2, max_tokens=10, min_tokens=3, stop_token_ids=[5])
    r.output_token_ids = [2]
    assert r.check_stop(2) is None
    r.output_token_ids = [2, 5, 2]
    assert r.check_stop(2) == RequestStatus.FINISHED_STOPPED
    r2 = request("b", 2, max_tokens=10, ignore_eos=True)
    r2.output_token_ids = [2]
    assert r2.check_stop(2) is None
