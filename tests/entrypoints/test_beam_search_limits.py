"""Beam search refuses what a plain request is refused (max_tokens past --max-model-len), range-checks
length_penalty, and grows its beams without copying their histories per candidate. Offline: the server's
beam search runs the same checks and search (tests/entrypoints/openai/test_beam_search_server.py)."""
from __future__ import annotations

import asyncio
import json
import time
import tracemalloc

import pytest

from vllm import LLM
from vllm.beam_search import beam_search
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm import AsyncLLM
from vllm.entrypoints.openai.metrics import Metrics
from vllm.entrypoints.openai.protocol import CompletionRequest
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.serving_engine import ServerSettings
from vllm.outputs import CompletionOutput, Logprob, RequestOutput
from vllm.sampling_params import BeamSearchParams, SamplingParams

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def llm():
    llm = LLM(max_model_len=MAX_MODEL_LEN, dtype="float32")
    yield llm
    assert not llm.llm_engine.has_unfinished_requests()


def test_max_tokens_past_max_model_len_is_refused_as_for_a_plain_request(llm):
    prompt = list(range(1, MAX_MODEL_LEN - 2))
    with pytest.raises(ValueError) as plain:
        llm.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.monotonic()
    with pytest.raises(ValueError) as beam:
        llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=4))
    assert str(beam.value) == str(plain.value) and "--max-model-len (64)" in str(beam.value)
    assert time.monotonic() - start < 1, "refused before any step runs"
    assert not llm.llm_engine.has_unfinished_requests()
    # Exactly at the limit is fine: the last step's prompt leaves room for its one token.
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))[0]
    assert len(out.sequences[0].tokens) == MAX_MODEL_LEN


@pytest.mark.parametrize("value", [1e5, 1e308, -1e308, float("inf"), float("nan"), 10.5, "1"])
def test_length_penalty_outside_its_range_is_refused_by_name(value):
    with pytest.raises(ValueError, match=r"length_penalty must be a finite number in \[-10, 10\]"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=value)
    BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=-10.0)
    BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=10)


def test_candidates_share_their_beams_history():
    """A step's 2 x width x width candidates must not each copy their beam's sequence: with a 40K-token prompt
    such copies would peak at 200 x 320 KB; the search may hold only the kept beams' sequences (the engine's
    prompts) and the one being sent."""
    prompt = list(range(40_000))
    row = {1000 + r: Logprob(-0.1 * r, r + 1) for r in range(20)}

    def generate(batch, params):
        return [RequestOutput("r", None, [], None, [CompletionOutput(0, "", [0], None, [row])], True)
                for _ in batch]

    tracemalloc.start()
    try:
        out = beam_search(generate, None, [prompt], BeamSearchParams(beam_width=10, max_tokens=3, ignore_eos=True),
                          frozenset())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(out[0].sequences) == 10 and out[0].sequences[0].tokens[:-3] == prompt
    copy = 8 * len(prompt)
    assert peak < 40 * copy, f"peak {peak / copy:.0f} prompt copies"


def leaving_client(body: dict, after_s: float):
    """A starlette Request whose client disconnects `after_s` seconds after sending `body`."""
    from starlette.requests import Request
    sent = [False]

    async def receive():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await asyncio.sleep(after_s)
        return {"type": "http.disconnect"}
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive)


def test_a_search_whose_client_leaves_is_aborted():
    """The server's handler, in process: a 400-step search of 4 beams whose client leaves after 0.5 s returns
    (499) within seconds, streamed or not, leaving no engine request behind and starting none later."""
    async def go():
        engine = AsyncLLM.from_engine_args(EngineArgs(max_model_len=512, dtype="float32"), multiprocess=False)
        core = engine.client.engine
        serving = OpenAIServingCompletion(engine, ServerSettings(["m"], log_requests=False), Metrics(engine, "m"))
        try:
            for stream in (True, False):
                body = {"prompt": "def add(a, b):", "use_beam_search": True, "n": 4, "temperature": 0,
                        "max_tokens": 400, "ignore_eos": True, "stream": stream}
                response = await asyncio.wait_for(
                    serving.create(CompletionRequest(**body), leaving_client(body, 0.5)), 20)
                assert response.status_code == 499, stream
                await asyncio.sleep(0.3)  # the loop processes the aborts
                assert not core.has_unfinished_requests() and not engine.collectors, stream
                await asyncio.sleep(1.0)  # a search left running would have started its next step
                assert not core.has_unfinished_requests() and not engine.collectors, stream
        finally:
            await engine.shutdown()
    asyncio.run(go())
