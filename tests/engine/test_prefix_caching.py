"""Prefix caching end to end (CPU, the trained built-in model): greedy output with the cache on equals the output
with it off, token for token, over multi-turn conversations and shared system prompts, with ngram and DSpark
speculation, async scheduling, preemption under a tiny cache, eviction and aborts; hits happen where they must;
every block and snapshot is back in its pool afterwards."""
from __future__ import annotations

import pytest

from code_prompts import CODE_PROMPTS

from vllm import LLM, SamplingParams
from vllm.assets import DEFAULT_DSPARK_DIR

INTERVAL, BLOCK = 32, 16
SYSTEM = "You are a careful assistant for a software team. Answer with code when you can. " * 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

SPECS = {"none": None, "ngram": {"method": "ngram", "num_speculative_tokens": 3},
         "dspark": {"method": "dspark", "model": str(DEFAULT_DSPARK_DIR), "num_speculative_tokens": 3}}


def _llm(caching: bool, spec: str = "none", **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 512)
    kwargs.setdefault("max_num_batched_tokens", 128)
    return LLM(dtype="float32", enable_prefix_caching=caching, kda_snapshot_interval=INTERVAL,
               speculative_config=SPECS[spec], **kwargs)


def _conversation(llm: LLM, turns: list[str]) -> tuple[list[list[int]], list[int], list[int]]:
    """Turn after turn, each prompt the whole history (token ids): the outputs, each turn's cached tokens, and
    each turn's history length before its new message (prompt + answer of the turn before)."""
    history: list[int] = []
    outputs, cached, before = [], [], []
    tok = llm.get_tokenizer()
    for text in turns:
        before.append(len(history))
        prompt = history + tok.encode(text)
        out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
        outputs.append(list(out.outputs[0].token_ids))
        cached.append(out.num_cached_tokens)
        history = prompt + outputs[-1]
    return outputs, cached, before


TURNS = [SYSTEM + "Write a function that reverses a list.", " Now make it work on strings too.",
         " Add type hints.", " And a docstring, please."]


@pytest.mark.parametrize("spec,async_scheduling,recover", [("none", False, False), ("none", True, False),
                                                           ("ngram", False, False), ("dspark", True, False),
                                                           ("dspark", True, True)],
                         ids=["none-sync", "none-async", "ngram", "dspark-async", "dspark-async-recoverssm"])
def test_a_conversation_reuses_its_history_and_answers_the_same(spec, async_scheduling, recover):
    """With RecoverSSM a decode row's snapshot is the state its commit passes at the boundary."""
    kwargs = dict(async_scheduling=async_scheduling, use_replayssm=recover)
    want, off_cached, _ = _conversation(_llm(False, spec, **kwargs), TURNS)
    assert off_cached == [0] * len(TURNS)
    llm = _llm(True, spec, **kwargs)
    got, cached, before = _conversation(llm, TURNS)
    assert got == want
    assert cached[0] == 0
    for n, history in zip(cached[1:], before[1:]):
        # Everything of the turn before but at most one snapshot interval (and the block it ends in).
        assert history - INTERVAL - BLOCK <= n <= history, (cached, before)
    llm.llm_engine.kv_cache_manager.assert_all_free()
    sched = llm.llm_engine.scheduler
    assert sched.prefix_cache_hits == sum(cached) and sched.prefix_cache_queries > sched.prefix_cache_hits


def test_a_shared_system_prompt_hits_from_the_third_request_on():
    """The first request leaves its blocks; the second finds them but no snapshot inside, so its prompt chunk
    stops at their end to take one; from the third on the shared prefix is a hit."""
    prompts = [SYSTEM + q + " Explain each step of it, the edge cases, and how you would test it." * 2
               for q in ("Sort a list.", "Parse JSON.", "Read a file.", "Zip two lists.")]
    want = [o.outputs[0].token_ids for o in _llm(False).generate(prompts, GREEDY, use_tqdm=False)]
    llm = _llm(True)
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == want
    ids = [o.prompt_token_ids for o in outs]
    shared = next(i for i in range(min(map(len, ids))) if len({tuple(x[:i + 1]) for x in ids}) > 1)
    assert [o.num_cached_tokens for o in outs] == [0, 0, shared // BLOCK * BLOCK, shared // BLOCK * BLOCK]
    llm.llm_engine.kv_cache_manager.assert_all_free()


@pytest.mark.parametrize("spec", ["none", "dspark"])
def test_preemption_eviction_and_aborts_under_a_tiny_cache(spec):
    """Many requests sharing prefixes through a cache that holds few of them: preemptions, blocks and snapshots
    evicted and reused, aborts mid-flight; the outputs stay those of no caching and nothing leaks."""
    prompts = [SYSTEM[:120 * (1 + i % 3)] + p for i, p in enumerate(CODE_PROMPTS * 2)]
    kwargs = dict(max_num_batched_tokens=48, num_gpu_blocks_override=40, num_kda_snapshots=3, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in _llm(False, spec, **kwargs).generate(prompts, params, use_tqdm=False)]
    llm = _llm(True, spec, **kwargs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert llm.llm_engine.scheduler.prefix_cache_hits > 0
    kv = llm.llm_engine.kv_cache_manager
    assert kv.block_pool.num_evicted > 0 and kv.snapshots.num_evicted > 0
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    for _ in range(5):
        engine.step()
    engine.abort_request(["r1", "r4", "r6"])
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    kept = [i for i in range(len(prompts)) if i not in (1, 4, 6)]
    assert [done[f"r{i}"] for i in kept] == [want[i] for i in kept]
    engine.kv_cache_manager.assert_all_free()


def test_reset_prefix_cache_forgets_every_prefix():
    llm = _llm(True)
    prompt = SYSTEM + "Count to ten."
    # The second run keeps the state where the first one's blocks end; the third hits there.
    first, _, again = (llm.generate([prompt], GREEDY, use_tqdm=False)[0] for _ in range(3))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert llm.llm_engine.reset_prefix_cache()
    after = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0 and after.outputs[0].token_ids == first.outputs[0].token_ids
    llm.llm_engine.kv_cache_manager.assert_all_free()
