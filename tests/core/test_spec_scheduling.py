"""Scheduler under speculative decoding (no model): row kinds and tags, the padded prompt tail, draft budgets,
cache reservation of drafts and 1 + K state slots, multi-token updates, stops inside a verify step, spec stats,
preemption, and the runner's input batch built from such a step."""
from __future__ import annotations

import pytest
import torch

from vllm.config import SchedulerConfig
from vllm.core.kv_cache_manager import NULL_STATE_SLOT, KVCacheManager
from vllm.core.request import Request, RequestStatus
from vllm.core.scheduler import Scheduler, SchedulerOutput
from vllm.core.sentinels import PLACEHOLDER_TOKEN_ID
from vllm.sampling_params import SamplingParams
from vllm.spec_decode.metrics import SpecDecodeStats
from vllm.worker.input_batch import InputBatch

K = 3
EOS = 99  # out of the way of the small draft ids the tests use
BLOCK = 4
FILLER = 7  # the token a sampling row gets when a test does not care which


def spec_request(rid: str, n_prompt: int, max_tokens: int = 16, speculate: bool = True, **params) -> Request:
    # Prompt ids start at 100 so they never collide with EOS, FILLER or the drafts the tests pick.
    return Request(rid, list(range(100, 100 + n_prompt)), SamplingParams(max_tokens=max_tokens, **params), max_tokens,
                   frozenset({EOS}), speculate=speculate, spec_stats=SpecDecodeStats(K))


def make(budget: int = 64, max_model_len: int = 128, blocks: int = 200, state_slots: int = 1 + 8 * (1 + K),
         max_seqs: int = 8) -> Scheduler:
    """A scheduler with K drafts; `state_slots` counts the null slot (default: room for 8 requests)."""
    kv = KVCacheManager(blocks, BLOCK, state_slots, needs_blocks=True, needs_slots=True, slots_per_request=1 + K)
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len)
    return Scheduler(config, kv, num_speculative_tokens=K)


def rows(out: SchedulerOutput) -> list[tuple[str, int, bool, int]]:
    """(id, tokens, is_prefilling, tag) per scheduled row, in step order."""
    return [(x.request.request_id, x.num_tokens, x.is_prefilling, x.num_draft_tokens) for x in out.scheduled]


def update(s: Scheduler, out: SchedulerOutput, sampled: dict[str, list[int]] | None = None) -> list[Request]:
    """Feed the step's sampled tokens back: `sampled` where given, else one FILLER token per sampling row."""
    sampled = sampled or {}
    tokens = {x.request.request_id: sampled.get(x.request.request_id, [FILLER]) for x in out.scheduled if x.samples}
    return s.update_from_output(out, tokens)


def step(s: Scheduler, sampled: dict[str, list[int]] | None = None) -> SchedulerOutput:
    out = s.schedule()
    update(s, out, sampled)
    return out


def to_decoding(s: Scheduler, *reqs: Request) -> None:
    """Add the requests and prefill their whole prompts in one step, so they are decoding afterwards."""
    for r in reqs:
        s.add_request(r)
    out = step(s)
    assert all(x.samples for x in out.scheduled) and not any(r.is_prefilling for r in reqs)


# --- row kinds ---------------------------------------------------------------------------------------------


def test_prompt_chunk_of_one_plus_k_tokens_stays_prefill():
    # A fresh prompt of exactly 1 + K tokens, and a continued chunk of 1 + K (with prior state): both are
    # prompt work, which a token-count rule ("1 + K tokens = a verify row") would misclassify.
    s = make(budget=1 + K)
    s.add_request(spec_request("a", 2 * (1 + K)))
    out = step(s)
    assert rows(out) == [("a", 1 + K, True, -1)]
    out = s.schedule()
    assert rows(out) == [("a", 1 + K, True, -1)] and out.scheduled[0].draft_token_ids == []
    assert out.scheduled[0].samples
    update(s, out)
    assert s.requests["a"].num_accepted_tokens == 1 and s.requests["a"].num_computed_tokens == 2 * (1 + K)


def test_padded_prompt_tail_is_a_verify_row_with_placeholders():
    s = make(budget=5)
    a = spec_request("a", 6)
    s.add_request(a)
    step(s)  # 5 prompt tokens; one left, with prior state
    out = s.schedule()
    row = out.scheduled[0]
    assert rows(out) == [("a", 1 + K, False, K)]
    assert row.draft_token_ids == [PLACEHOLDER_TOKEN_ID] * K and row.samples
    # Cache room for the placeholders too: 5 + 1 + K = 9 tokens -> 3 blocks (an unpadded tail needs 2).
    assert len(s.kv.block_ids("a")) == 3
    update(s, out, {"a": [55]})  # placeholders are always rejected: one sampled token
    assert a.num_computed_tokens == 6 and a.num_accepted_tokens == 1 and a.output_token_ids == [55]
    assert not a.is_prefilling and a.spec_token_ids == []
    # A placeholder-only row verifies no real draft: it is not counted as one.
    assert (a.spec_stats.num_drafts, a.spec_stats.num_draft_tokens) == (0, 0)
    assert (s.spec_stats.num_drafts, s.spec_stats.num_draft_tokens) == (0, 0)


def test_fresh_one_token_prompt_is_not_padded():
    s = make()
    s.add_request(spec_request("a", 1))
    out = s.schedule()
    assert rows(out) == [("a", 1, True, -1)] and out.scheduled[0].draft_token_ids == []


def test_request_without_speculation_is_not_padded():
    s = make(budget=5)
    s.add_request(spec_request("a", 6, speculate=False))
    step(s)
    out = s.schedule()
    assert rows(out) == [("a", 1, True, -1)] and out.scheduled[0].samples


@pytest.mark.parametrize("max_model_len,placeholders", [(128, K), (8, 2), (7, 1)])
def test_padding_is_trimmed_by_max_model_len(max_model_len, placeholders):
    # The placeholders sit at positions 6.. and every position must stay below max_model_len.
    s = make(budget=5, max_model_len=max_model_len)
    s.add_request(spec_request("a", 6))
    step(s)
    out = s.schedule()
    assert rows(out) == [("a", 1 + placeholders, False, placeholders)]
    assert out.scheduled[0].draft_token_ids == [PLACEHOLDER_TOKEN_ID] * placeholders


@pytest.mark.parametrize("budget,x_drafts,placeholders", [(6, 3, 1), (6, 2, 2), (6, 0, 3), (5, 3, 0)])
def test_padding_is_trimmed_by_the_token_budget(budget, x_drafts, placeholders):
    # x (running first) takes 1 + x_drafts tokens; the padded tail gets what is left after its one prompt token.
    s = make(budget=budget)
    x, a = spec_request("x", budget - 4), spec_request("a", 5)
    s.add_request(x)
    s.add_request(a)
    step(s)  # x: its whole prompt; a: 4 of 5 prompt tokens
    x.spec_token_ids = [60 + i for i in range(x_drafts)]
    out = s.schedule()
    # With no room for a placeholder the tail is a plain 1-token prefill chunk, never an empty verify row.
    tail = ("a", 1 + placeholders, False, placeholders) if placeholders else ("a", 1, True, -1)
    assert rows(out) == [("x", 1 + x_drafts, False, x_drafts), tail]
    assert sum(r.num_tokens for r in out.scheduled) <= budget


def tagged_batch() -> tuple[Scheduler, SchedulerOutput]:
    """A step with a verify row (a, K drafts), a padded prompt tail (b) and a fresh prompt chunk (c).

    Step 1: a prefills 2, b 8 of 15. Step 2: a verifies 3 drafts (2 accepted), b prefills 6 more (1 left).
    Step 3 (returned, not updated): a verifies [1, 2, 3], b is padded to 1 + K, c gets the 2 tokens left.
    """
    s = make(budget=10)
    a, b = spec_request("a", 2), spec_request("b", 15)
    s.add_request(a)
    s.add_request(b)
    step(s, {"a": [40]})
    a.spec_token_ids = [41, 42, 43]
    step(s, {"a": [41, 42, 44]})
    a.spec_token_ids = [1, 2, 3]
    s.add_request(spec_request("c", 2))
    return s, s.schedule()


def test_batch_tags_verify_padded_tail_and_prefill():
    _, out = tagged_batch()
    assert rows(out) == [("a", 1 + K, False, K), ("b", 1 + K, False, K), ("c", 2, True, -1)]
    assert [x.num_draft_tokens for x in out.scheduled] == [K, K, -1]
    assert [x.draft_token_ids for x in out.scheduled] == [[1, 2, 3], [PLACEHOLDER_TOKEN_ID] * K, []]
    assert [x.samples for x in out.scheduled] == [True, True, True]


def test_input_batch_carries_checkpoint_columns_tags_and_placeholders():
    # The runner's view of tagged_batch's step: 2-D state columns, num_accepted, tags, placeholder ids as 0.
    s, out = tagged_batch()
    batch = InputBatch(8, 10, 16, BLOCK, torch.device("cpu"), slots_per_request=1 + K)
    common = batch.prepare(out, s.kv)
    assert common.query_start_loc_cpu.tolist() == [0, 4, 8, 10]
    assert common.num_draft_tokens.tolist() == [K, K, -1]
    assert common.is_prefilling.tolist() == [False, False, True]
    assert common.state_indices_cpu.tolist() == [s.kv.state_slots(r) for r in "abc"]
    assert tuple(common.state_indices.shape) == (3, 1 + K)
    assert common.num_accepted_tokens.tolist() == [3, 1, 1]  # a kept 1 + 2 tokens last step
    # a: its last sampled token then the drafts; b: its last prompt token then 3 placeholders run as 0.
    assert batch.input_ids.cpu[:10].tolist() == [44, 1, 2, 3, 114, 0, 0, 0, 100, 101]
    assert batch.positions.cpu[:10].tolist() == [5, 6, 7, 8, 14, 15, 16, 17, 0, 1]
    assert common.seq_lens_cpu.tolist() == [9, 18, 2]


# --- decode rows and the cache -----------------------------------------------------------------------------


@pytest.mark.parametrize("n_drafts", [0, 1, K])
def test_decode_row_runs_one_plus_drafts(n_drafts):
    s = make()
    a = spec_request("a", 3)
    to_decoding(s, a)
    a.spec_token_ids = [60 + i for i in range(n_drafts)]
    out = s.schedule()
    assert rows(out) == [("a", 1 + n_drafts, False, n_drafts)]
    assert out.scheduled[0].draft_token_ids == a.spec_token_ids and out.scheduled[0].samples


def test_drafts_are_trimmed_to_the_budget_and_stats_count_only_those():
    s = make(budget=3)
    a = spec_request("a", 2)
    to_decoding(s, a)
    a.spec_token_ids = [60, 61, 62]
    out = s.schedule()
    assert rows(out) == [("a", 3, False, 2)] and out.scheduled[0].draft_token_ids == [60, 61]
    update(s, out, {"a": [60, 61, 70]})
    assert a.output_token_ids == [FILLER, 60, 61, 70] and a.num_computed_tokens == 5
    assert (s.spec_stats.num_drafts, s.spec_stats.num_draft_tokens, s.spec_stats.num_accepted_tokens) == (1, 2, 2)
    assert s.spec_stats.num_accepted_tokens_per_pos == [1, 1, 0]


@pytest.mark.parametrize("n_drafts,blocks", [(0, 2), (K, 3)])
def test_cache_reserves_blocks_for_every_draft(n_drafts, blocks):
    # 5 prompt tokens computed, the 6th (sampled) runs now with the drafts: 6 + n_drafts tokens of cache.
    s = make()
    a = spec_request("a", 5)
    to_decoding(s, a)
    assert len(s.kv.block_ids("a")) == 2
    a.spec_token_ids = [60 + i for i in range(n_drafts)]
    s.schedule()
    assert len(s.kv.block_ids("a")) == blocks


def test_each_request_holds_one_plus_k_state_slots_for_life():
    s = make(state_slots=1 + 2 * (1 + K) + K)  # two requests' columns, and K slots: one short of a third
    a, b, c = spec_request("a", 3), spec_request("b", 3), spec_request("c", 3)
    for r in (a, b, c):
        s.add_request(r)
    out = step(s)
    assert [x.request.request_id for x in out.scheduled] == ["a", "b"] and list(s.waiting) == [c]
    cols = {r: s.kv.state_slots(r) for r in "ab"}
    for r in "ab":
        assert len(cols[r]) == 1 + K and len(set(cols[r])) == 1 + K and NULL_STATE_SLOT not in cols[r]
    assert not set(cols["a"]) & set(cols["b"])
    assert len(s.kv.free_slots) == K and s.kv.state_slots("c") == [NULL_STATE_SLOT] * (1 + K)  # all or nothing
    a.spec_token_ids = [60, 61, 62]
    step(s, {"a": [60, 9]})
    assert {r: s.kv.state_slots(r) for r in "ab"} == cols  # verify steps never move the columns
    s.abort(["a"])
    out = step(s)
    assert "c" in [x.request.request_id for x in out.scheduled] and len(s.kv.state_slots("c")) == 1 + K
    s.abort(["b", "c"])
    s.kv.assert_all_free()


# --- update_from_output ------------------------------------------------------------------------------------


@pytest.mark.parametrize("accepted", range(K + 1))
def test_verify_row_advances_by_one_plus_accepted(accepted):
    s = make()
    a = spec_request("a", 4)
    to_decoding(s, a)
    drafts = [60, 61, 62]
    a.spec_token_ids = list(drafts)
    out = s.schedule()
    sampled = drafts[:accepted] + [90]  # accepted drafts, then the recovered or bonus token
    updated = update(s, out, {"a": sampled})
    assert updated == [a]
    assert a.num_computed_tokens == 4 + 1 + accepted
    assert a.num_accepted_tokens == 1 + accepted
    assert a.output_token_ids == [FILLER] + sampled
    assert a.spec_token_ids == []
    assert a.num_tokens - a.num_computed_tokens == 1  # the last sampled token is the next step's input
    assert (a.spec_stats.num_drafts, a.spec_stats.num_draft_tokens, a.spec_stats.num_accepted_tokens) == (
        1, K, accepted)
    assert a.spec_stats.num_accepted_tokens_per_pos == [1] * accepted + [0] * (K - accepted)


@pytest.mark.parametrize("params,sampled,output,status", [
    ({"max_tokens": 3}, [60, 61, 62, 63], [FILLER, 60, 61], RequestStatus.FINISHED_LENGTH),
    ({}, [60, EOS, 62, 63], [FILLER, 60, EOS], RequestStatus.FINISHED_STOPPED),
    ({"stop_token_ids": [61]}, [61, 62, 63, 64], [FILLER, 61], RequestStatus.FINISHED_STOPPED),
], ids=["max_tokens", "eos", "stop_token_id"])
def test_stop_inside_a_verify_step_drops_the_tokens_after_it(params, sampled, output, status):
    s = make()
    a = spec_request("a", 4, **params)
    to_decoding(s, a)
    a.spec_token_ids = sampled[:K]  # every draft is accepted: the stop comes from the tokens, not a rejection
    updated = update(s, s.schedule(), {"a": sampled})
    assert updated == [a] and a.status == status and a.output_token_ids == output
    if "stop_token_ids" in params:
        assert a.stop_reason == 61
    assert "a" not in s.requests and a not in s.running
    s.kv.assert_all_free()


def test_spec_stats_count_drafts_tokens_and_positions_exactly():
    s = make(budget=16)
    a, b, p = spec_request("a", 3), spec_request("b", 3), spec_request("p", 11)
    for r in (a, b, p):
        s.add_request(r)
    out = step(s)  # a, b: whole prompts; p: 10 of 11
    assert rows(out) == [("a", 3, True, -1), ("b", 3, True, -1), ("p", 10, True, -1)]
    a.spec_token_ids, b.spec_token_ids = [1, 3, 4], [4, 5]
    out = step(s, {"a": [1, 3, 9], "b": [8], "p": [9]})  # a keeps 2 of 3, b 0 of 2; p is a padded tail
    assert [x.num_draft_tokens for x in out.scheduled] == [K, 2, K]
    b.spec_token_ids = [1, 2, 3]
    step(s, {"b": [1, 2, 3, 9]})  # a verifies nothing (no drafts), b keeps all 3
    assert a.status == b.status == p.status == RequestStatus.RUNNING
    assert (a.spec_stats.num_drafts, a.spec_stats.num_draft_tokens, a.spec_stats.num_accepted_tokens) == (1, 3, 2)
    assert a.spec_stats.num_accepted_tokens_per_pos == [1, 1, 0]
    assert (b.spec_stats.num_drafts, b.spec_stats.num_draft_tokens, b.spec_stats.num_accepted_tokens) == (2, 5, 3)
    assert b.spec_stats.num_accepted_tokens_per_pos == [1, 1, 1]
    assert (p.spec_stats.num_drafts, p.spec_stats.num_draft_tokens, p.spec_stats.num_accepted_tokens) == (0, 0, 0)
    g = s.spec_stats
    assert (g.num_drafts, g.num_draft_tokens, g.num_accepted_tokens) == (3, 8, 5)
    assert g.num_accepted_tokens_per_pos == [2, 2, 1]
    assert g.mean_acceptance_length == pytest.approx(1 + 5 / 3)
    assert g.acceptance_rate == pytest.approx(5 / 8)


# --- preemption and release --------------------------------------------------------------------------------


def test_preemption_clears_drafts_and_resets_accepted():
    s = make(blocks=5)  # 20 tokens of cache
    a, b = spec_request("a", 4), spec_request("b", 4)
    to_decoding(s, a, b)  # 1 block each
    a.spec_token_ids, b.spec_token_ids = [1, 2, 3], [4, 5, 6]
    step(s, {"a": [1, 2, 9], "b": [4, 5, 9]})  # both keep 2 drafts: 8 tokens, 7 computed, 2 blocks each
    assert b.num_accepted_tokens == 3 and s.kv.block_pool.num_free == 1
    b_cols = list(s.kv.state_slots("b"))
    a.spec_token_ids, b.spec_token_ids = [1, 2, 3], [4, 5, 6]
    out = s.schedule()  # a takes the last block for its drafts; b, the newest, cannot grow and is preempted
    assert out.preempted_ids == ["b"] and rows(out) == [("a", 1 + K, False, K)]
    assert b.status == RequestStatus.PREEMPTED and s.waiting[0] is b
    assert b.spec_token_ids == [] and b.num_accepted_tokens == 1 and b.num_computed_tokens == 0
    assert "b" not in s.kv.req_slots and "b" not in s.kv.req_blocks and set(b_cols) <= set(s.kv.free_slots)
    update(s, out, {"a": [1, 9]})
    s.abort(["a"])
    out = s.schedule()  # b comes back as a prefill of prompt + outputs, with no drafts
    assert rows(out) == [("b", 8, True, -1)] and out.scheduled[0].draft_token_ids == []
    update(s, out)
    s.abort(["b"])
    s.kv.assert_all_free()


def test_drafts_never_exceed_the_checkpoint_columns():
    # A proposer handing over more than K drafts must not overrun the request's 1 + K state columns.
    s = make()
    a = spec_request("a", 3)
    to_decoding(s, a)
    a.spec_token_ids = list(range(60, 60 + 2 * K))
    out = s.schedule()
    assert out.scheduled[0].draft_token_ids == list(range(60, 60 + K)) and out.scheduled[0].num_tokens == 1 + K
