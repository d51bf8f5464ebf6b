"""A step that raises because of one request fails that request alone: the others keep their exact outputs and
nothing leaks, offline (LLM.generate) and online (AsyncLLM), whether the fault is in the model step (after the
model has already updated every row's cache and state) or in one request's output processing."""
from __future__ import annotations

import asyncio

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm import AsyncLLM, RequestFailed
from vllm.engine.detokenizer import IncrementalDetokenizer
from vllm.worker.model_runner import ModelRunner

ARGS = dict(max_model_len=256, dtype="float32", max_num_batched_tokens=32)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 512, (n,), generator=gen).tolist() for n in lengths]


BATCH = _prompts([5, 40, 9, 23, 64])
BAD = BATCH[2]


@pytest.fixture(scope="module")
def reference():
    return [o.outputs[0].token_ids for o in LLM(**ARGS).generate(BATCH, GREEDY, use_tqdm=False)]


def _fault_in_model_step(monkeypatch, after_tokens: int):
    """Every step holding BAD once it has `after_tokens` outputs raises, after the real step ran (so every
    row's KDA state and latent cache were already written)."""
    real = ModelRunner.execute_model
    steps = {"failed": 0}

    def execute(self, out, *args, **kwargs):
        result = real(self, out, *args, **kwargs)
        if any(s.request.prompt_token_ids == BAD and len(s.request.output_token_ids) >= after_tokens
               for s in out.scheduled):
            steps["failed"] += 1
            raise RuntimeError("injected fault")
        return result
    monkeypatch.setattr(ModelRunner, "execute_model", execute)
    return steps


@pytest.mark.parametrize("after_tokens", [0, 4], ids=["in_prefill", "mid_decode"])
def test_offline_fault_fails_only_its_request(monkeypatch, reference, after_tokens):
    llm = LLM(**ARGS)
    steps = _fault_in_model_step(monkeypatch, after_tokens)
    outs = llm.generate(BATCH, GREEDY, use_tqdm=False)
    bad = BATCH.index(BAD)
    assert steps["failed"] >= 2, "the fault hit a shared step, then the request alone"
    assert outs[bad].outputs[0].finish_reason == "error" and "injected fault" in outs[bad].error
    assert len(outs[bad].outputs[0].token_ids) == after_tokens
    for i, (out, want) in enumerate(zip(outs, reference)):
        if i != bad:
            assert out.outputs[0].token_ids == want and out.outputs[0].finish_reason == "length" and out.error is None
    assert not llm.llm_engine.has_unfinished_requests()
    llm.llm_engine.kv_cache_manager.assert_all_free()


def test_offline_fault_in_output_processing_fails_only_its_request(monkeypatch, reference):
    llm = LLM(**ARGS)
    real = IncrementalDetokenizer.update
    calls: dict[int, int] = {}
    marked = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, seed=7)  # greedy: the seed is a tag

    def update(self, new_token_ids, check_stop=True):
        calls[id(self)] = calls.get(id(self), 0) + 1
        if self.params.seed == 7 and calls[id(self)] == 4:
            raise UnicodeError("injected detokenizer fault")
        return real(self, new_token_ids, check_stop)
    monkeypatch.setattr(IncrementalDetokenizer, "update", update)
    bad = BATCH.index(BAD)
    outs = llm.generate(BATCH, [marked if i == bad else GREEDY for i in range(len(BATCH))], use_tqdm=False)
    assert outs[bad].outputs[0].finish_reason == "error" and "injected detokenizer fault" in outs[bad].error
    assert len(outs[bad].outputs[0].token_ids) == 4
    assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i != bad] == \
        [r for i, r in enumerate(reference) if i != bad]
    llm.llm_engine.kv_cache_manager.assert_all_free()


def test_online_fault_fails_only_its_stream(monkeypatch, reference):
    _fault_in_model_step(monkeypatch, after_tokens=3)

    async def stream(engine, prompt, rid):
        try:
            return [o async for o in engine.generate({"prompt_token_ids": prompt}, GREEDY, rid)][-1]
        except RequestFailed as e:
            return e

    async def main():
        engine = AsyncLLM.from_engine_args(EngineArgs(**ARGS), multiprocess=False)
        results = await asyncio.gather(*(stream(engine, p, f"r{i}") for i, p in enumerate(BATCH)))
        await engine.shutdown()
        return engine, results

    engine, results = asyncio.run(main())
    bad = BATCH.index(BAD)
    assert isinstance(results[bad], RequestFailed) and "injected fault" in str(results[bad])
    for i, (out, want) in enumerate(zip(results, reference)):
        if i != bad:
            assert out.finished and out.outputs[0].token_ids == want
    engine.client.engine.kv_cache_manager.assert_all_free()
