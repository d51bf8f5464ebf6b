"""OpenAIServing.generate's one-prompt path (no task or queue in between): what the queued path guarantees holds,
and both paths give the same outputs."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from vllm.entrypoints.openai.protocol import APIError
from vllm.entrypoints.openai.serving_engine import OpenAIServing, ServerSettings
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams


class Engine:
    """AsyncLLM's generate as the handlers see it; records aborts (its finally before the last output)."""

    def __init__(self, tokens: int = 4, fail: Exception | None = None, finish: str = "length") -> None:
        self.tokens, self.fail, self.finish = tokens, fail, finish
        self.aborted: list[str] = []
        self.config = SimpleNamespace(model_config=SimpleNamespace(get_diff_sampling_param=dict))
        self.tokenizer = SimpleNamespace(all_special_ids=[0])

    async def generate(self, prompt, params, request_id):
        done = False
        try:
            for t in range(self.tokens):
                await asyncio.sleep(0)
                if self.fail is not None and t == 1:
                    raise self.fail
                done = t == self.tokens - 1
                yield RequestOutput(request_id, None, list(prompt), None,
                                    [CompletionOutput(0, str(t), [t], None, None, self.finish if done else None)],
                                    done)
        finally:
            if not done:
                self.aborted.append(request_id)


def serving(engine) -> OpenAIServing:
    timers = []
    metrics = SimpleNamespace(timer=lambda: timers.append([]) or SimpleNamespace(
        update=timers[-1].append, finish=lambda out, params, generated: timers[-1].append(("done", generated))))
    s = OpenAIServing(engine, ServerSettings(["m"], log_requests=False), metrics)
    s.timers = timers
    return s


PARAMS = SamplingParams(max_tokens=4, output_kind=RequestOutputKind.DELTA)


async def collect(s, prompts):
    return [(i, o.outputs[0].token_ids, o.finished) async for i, o in s.generate(prompts, PARAMS, "r")]


def test_one_prompt_gives_what_the_queued_path_gives_and_counts_tokens():
    one = serving(Engine())
    got = asyncio.run(collect(one, [[7, 8]]))
    assert got == [(0, [0], False), (0, [1], False), (0, [2], False), (0, [3], True)]
    assert one.timers == [[1, 2, 3, 4, ("done", [4])]]
    two = asyncio.run(collect(serving(Engine()), [[7, 8], [9]]))
    assert [x for x in two if x[0] == 0] == got


def test_closing_the_one_prompt_generator_aborts_its_request():
    engine = Engine(tokens=10)

    async def go():
        gen = serving(engine).generate([[1]], PARAMS, "r")
        await anext(gen)
        await gen.aclose()
    asyncio.run(go())
    assert engine.aborted == ["r-0"]


@pytest.mark.parametrize("prompts", [[[1]], [[1], [2]]], ids=["one", "queued"])
def test_engine_errors_and_shutdown_aborts_map_to_http_errors(prompts):
    with pytest.raises(APIError) as e:
        asyncio.run(collect(serving(Engine(fail=ValueError("temperature must be >= 0"))), prompts))
    assert e.value.status == 400
    with pytest.raises(APIError) as e:
        asyncio.run(collect(serving(Engine(fail=RuntimeError("boom"))), prompts))
    assert e.value.status == 500
    with pytest.raises(APIError) as e:
        asyncio.run(collect(serving(Engine(finish="abort")), prompts))
    assert e.value.status == 503
