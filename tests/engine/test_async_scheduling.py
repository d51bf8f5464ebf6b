"""Async scheduling (step N+1 scheduled and prepared while step N runs, its tokens a step late) gives exactly the
synchronous engine's outputs: with chunked prefill, late arrivals, preemption, stop conditions and aborts that
land while a step is in flight, penalties, min_tokens, logprobs and seeded sampling; and leaks nothing."""
from __future__ import annotations

import argparse

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.assets import DEFAULT_DSPARK_DIR
from vllm.engine.llm_engine import LLMEngine
from vllm.worker.model_runner import ModelRunner

BASE = dict(max_model_len=256, dtype="float32", max_num_batched_tokens=48)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LENGTHS = [5, 40, 1, 77, 16, 23, 130, 9, 58]
# DSpark drafts stay on the device, so their steps overlap too: the shipped draft of the built-in model.
DSPARK = {"method": "dspark", "model": str(DEFAULT_DSPARK_DIR), "num_speculative_tokens": 3}
WITH_AND_WITHOUT_DSPARK = pytest.mark.parametrize("spec", [None, DSPARK], ids=["plain", "dspark"])


def prompts(lengths, seed=0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(5, 512, (n,), generator=gen).tolist()} for n in lengths]


def completions(outputs) -> list[tuple[list[int], str, str | None]]:
    return [(c.token_ids, c.text, c.finish_reason) for o in outputs for c in o.outputs]


@pytest.fixture
def engines(monkeypatch):
    """(sync LLM, async LLM) built alike, and a count of the async engine's steps queued while another step was
    still in flight (without which these tests would compare the synchronous engine with itself)."""
    overlapped = {"steps": 0}
    real = LLMEngine._drain

    def drain(self):
        # A step whose results are taken after a later step was launched ran overlapped with that one.
        overlapped["steps"] += self.in_flight is not None and self.in_flight[1] is not self.last_launched
        return real(self)
    monkeypatch.setattr(LLMEngine, "_drain", drain)
    made = []

    def make(**kwargs):
        pair = LLM(**{**BASE, **kwargs}, async_scheduling=False), LLM(**{**BASE, **kwargs}, async_scheduling=True)
        made.extend(pair)
        return pair
    yield make, overlapped
    for llm in made:
        assert not llm.llm_engine.has_unfinished_requests()
        llm.llm_engine.kv_cache_manager.assert_all_free()


@WITH_AND_WITHOUT_DSPARK
def test_greedy_is_identical_with_chunked_prefill_and_mixed_lengths(engines, spec):
    make, overlapped = engines
    sync, overlap = make(speculative_config=spec)
    batch = prompts(LENGTHS)
    want = completions(sync.generate(batch, GREEDY, use_tqdm=False))
    assert completions(overlap.generate(batch, GREEDY, use_tqdm=False)) == want
    assert overlapped["steps"] > 10
    if spec is not None:
        stats = overlap.llm_engine.spec_decode_stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, "some drafts kept, some rejected"


@WITH_AND_WITHOUT_DSPARK
def test_requests_arriving_while_a_step_is_in_flight(engines, spec):
    make, overlapped = engines
    sync, overlap = make(speculative_config=spec)
    batch = prompts(LENGTHS, seed=2)
    alone = [completions(sync.generate([p], GREEDY, use_tqdm=False)) for p in batch]
    engine = overlap.llm_engine
    done, pending, step = {}, list(enumerate(batch)), 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:
            i, p = pending.pop(0)
            engine.add_request(f"late-{i}", p, GREEDY)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = completions([out])
        step += 1
    assert [done[f"late-{i}"] for i in range(len(batch))] == alone
    assert overlapped["steps"] > 10


@WITH_AND_WITHOUT_DSPARK
def test_preemption_with_a_token_in_flight(engines, spec):
    make, overlapped = engines
    sync, overlap = make(num_gpu_blocks_override=6, max_model_len=64, max_num_batched_tokens=32,
                         speculative_config=spec)
    batch = prompts([9, 30, 17, 5, 22, 12])
    want = sync.generate(batch, GREEDY, use_tqdm=False)
    got = overlap.generate(batch, GREEDY, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in got) > 0, "the cache is small enough to force preemption"
    assert completions(got) == completions(want)
    assert overlapped["steps"] > 0


@WITH_AND_WITHOUT_DSPARK
def test_stop_conditions_land_mid_overlap_and_emit_nothing_extra(engines, spec):
    """A request whose token stops it has one more step in flight: that step's token must be dropped."""
    make, overlapped = engines
    sync, overlap = make(speculative_config=spec)
    batch = prompts([20, 7, 33, 11])
    free = [o.outputs[0].token_ids for o in sync.generate(batch, GREEDY, use_tqdm=False)]
    text = sync.get_tokenizer().decode(free[3])
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[free[0][3]]),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, stop=[text[len(text) // 2:len(text) // 2 + 2]]),
    ]
    want = completions(sync.generate(batch, params, use_tqdm=False))
    assert [w[2] for w in want] == ["stop", "length", "length", "stop"]
    assert completions(overlap.generate(batch, params, use_tqdm=False)) == want
    assert overlapped["steps"] > 0


@WITH_AND_WITHOUT_DSPARK
def test_abort_while_a_step_is_in_flight(engines, spec):
    make, overlapped = engines
    sync, overlap = make(speculative_config=spec)
    batch = prompts([10, 50, 90, 14])
    want = completions(sync.generate(batch[1::2], GREEDY, use_tqdm=False))
    engine = overlap.llm_engine
    for i, p in enumerate(batch):
        engine.add_request(str(i), p, GREEDY)
    outs = {}
    for _ in range(6):
        outs.update({o.request_id: o for o in engine.step()})
    assert engine.in_flight is not None, "the abort lands while a step holding the request runs"
    aborted = engine.abort_request(["0", "2"])
    assert sorted(o.request_id for o in aborted) == ["0", "2"]
    assert all(o.outputs[0].finish_reason == "abort" for o in aborted)
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    assert "0" not in outs or not outs["0"].finished
    assert completions([outs["1"], outs["3"]]) == want
    assert overlapped["steps"] > 0


def test_penalties_min_tokens_logprobs_and_seeds_are_identical(engines):
    make, overlapped = engines
    sync, overlap = make()
    batch = prompts([9, 30, 17, 5, 12])
    free = [o.outputs[0].token_ids for o in sync.generate(batch[3:4], GREEDY, use_tqdm=False)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8,
                       presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=10, ignore_eos=True,
                       frequency_penalty=0.4),
        SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, prompt_logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=5, stop_token_ids=[free[0][0]]),
        SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True),
    ]

    def full(outputs):
        return [(completions([o]), o.prompt_logprobs, [c.logprobs for c in o.outputs]) for o in outputs]
    want = full(sync.generate(batch, params, use_tqdm=False))
    assert full(overlap.generate(batch, params, use_tqdm=False)) == want
    assert overlapped["steps"] > 0
    assert not overlap.llm_engine.runner.sampling.penalties.rows, "rows of finished requests are freed"


def test_a_faulty_step_fails_only_its_request_with_a_step_in_flight(engines, monkeypatch):
    """The fault hits while the step before is still in flight: that step's outputs are kept, the faulty
    request alone fails once it is run by itself, the others give the synchronous engine's tokens."""
    make, overlapped = engines
    # The faulty step's requests are recomputed by a prefill. fla's Triton prefill computes fp32 dots in TF32 on a
    # GPU, which can flip a near-tied greedy token of the random model against the never-interrupted reference;
    # the torch prefill is exact, so any difference left is the engine's.
    sync, overlap = make(kda_prefill_backend="torch")
    batch = prompts([5, 40, 9, 23, 64])
    bad = batch[2]["prompt_token_ids"]
    want = completions(sync.generate(batch, GREEDY, use_tqdm=False))
    patched = ModelRunner.execute_model

    def execute(self, out, *args, **kwargs):
        result = patched(self, out, *args, **kwargs)
        if any(s.request.prompt_token_ids == bad and len(s.request.output_token_ids) >= 4 for s in out.scheduled):
            raise RuntimeError("injected fault")
        return result
    monkeypatch.setattr(ModelRunner, "execute_model", execute)
    outs = overlap.generate(batch, GREEDY, use_tqdm=False)
    got = completions(outs)
    assert got[2][2] == "error" and "injected fault" in outs[2].error
    assert 4 <= len(got[2][0]) <= 5 and got[2][0] == want[2][0][:len(got[2][0])]
    assert got[:2] + got[3:] == want[:2] + want[3:]
    assert overlapped["steps"] > 0


def test_async_scheduling_defaults_and_refusals():
    from vllm.engine.arg_utils import EngineArgs
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    assert EngineArgs(device="cpu").create_engine_config().scheduler_config.async_scheduling is False
    with pytest.raises(ValueError, match="--async-scheduling cannot be combined with ngram speculation"):
        EngineArgs(device="cpu", async_scheduling=True, speculative_config=ngram).create_engine_config()
    dspark = {"method": "dspark", "model": str(DEFAULT_DSPARK_DIR), "num_speculative_tokens": 2}
    assert EngineArgs(device="cpu", async_scheduling=True,
                      speculative_config=dspark).create_engine_config().scheduler_config.async_scheduling
    with pytest.raises(ValueError, match=r"engine argument async_scheduling='yes' \(str\) is invalid: expected bool "
                                         "or None"):
        EngineArgs(device="cpu", async_scheduling="yes").create_engine_config()
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    for argv, want in (([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)):
        args = EngineArgs.from_cli_args(parser.parse_args(argv))
        assert args.async_scheduling is want
    assert EngineArgs(device="cpu", async_scheduling=True).create_engine_config().scheduler_config.async_scheduling
