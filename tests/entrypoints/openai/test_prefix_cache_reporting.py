"""Prefix caching where users see it, the app in process over an in-process engine: usage's
prompt_tokens_details.cached_tokens (whole and streamed, completions and chat) is the outputs' num_cached_tokens
summed over the prompts, RequestOutput.num_cached_tokens is the prompt's, /metrics reads the engine's prefix-cache
counters, and POST /reset_prefix_cache runs the engine's reset between steps (200, or upstream's 409 when the
engine could not reset).

The cache's own behaviour (a repeated prompt hits it) is tested against `vllm serve` in
test_openai_upstream_compat.py."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm import AsyncLLM
from vllm.entrypoints.openai.api_server import build_app
from vllm.entrypoints.openai.serving_engine import ServerSettings
from vllm.outputs import CompletionOutput, RequestOutput


@pytest.fixture(scope="module")
def run():
    """One event loop for the module: the in-process engine's step loop, started in it, lives across tests."""
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.close()


@pytest.fixture(scope="module")
def engine(run):
    engine = AsyncLLM.from_engine_args(EngineArgs(max_model_len=256), multiprocess=False)
    yield engine
    run(engine.shutdown())


def app_client(engine, **settings) -> httpx.AsyncClient:
    app = build_app(engine, ServerSettings(served_model_names=["kimi"], log_requests=False, **settings))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def scripted(engine, cached: dict[int, int]):
    """Stands in for the engine's generate: each prompt (told apart by its length) answers 2 tokens per
    sample in DELTA outputs that carry that prompt's cached tokens, as the engine's do."""
    async def generate(prompt, params, request_id):
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else engine.tokenizer.encode(prompt)
        for k in range(2):
            await asyncio.sleep(0)
            last = k == 1
            yield RequestOutput(request_id, None, ids, None,
                                [CompletionOutput(i, "x", [7], None, None, "length" if last else None)
                                 for i in range(params.n)], last, num_cached_tokens=cached[len(ids)])
    return generate


def stream_usages(text: str) -> list[dict]:
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    return [e["usage"] for e in events if e.get("usage")]


def test_usage_cached_tokens_are_the_outputs_summed_once_per_prompt(engine, run, monkeypatch):
    tok = engine.tokenizer
    prompts = [" ".join(["word"] * 40), "a b"]
    cached = {len(tok.encode(prompts[0])): 16, len(tok.encode(prompts[1])): 3}
    assert len(cached) == 2
    monkeypatch.setattr(engine, "generate", scripted(engine, cached))

    async def go():
        async with app_client(engine, enable_prompt_tokens_details=True) as http:
            body = {"model": "kimi", "prompt": prompts, "n": 2, "max_tokens": 2}
            whole = (await http.post("/v1/completions", json=body)).json()
            streamed = await http.post("/v1/completions", json={**body, "stream": True,
                                                                 "stream_options": {"include_usage": True}})
            chat_body = {"model": "kimi", "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 2}
            chat_ids = (await http.post("/tokenize", json={"model": "kimi", "messages": chat_body["messages"],
                                                           "add_generation_prompt": True})).json()["tokens"]
            assert len(chat_ids) not in cached
            cached[len(chat_ids)] = 5
            chat = (await http.post("/v1/chat/completions", json=chat_body)).json()
            chat_stream = await http.post("/v1/chat/completions", json={
                **chat_body, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
            return whole, streamed.text, chat, chat_stream.text

    whole, streamed, chat, chat_stream = run(go())
    assert whole["usage"]["prompt_tokens_details"] == {"cached_tokens": 16 + 3}  # n=2: each prompt's once
    assert stream_usages(streamed)[-1]["prompt_tokens_details"] == {"cached_tokens": 16 + 3}
    assert chat["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}
    usages = stream_usages(chat_stream)
    assert len(usages) > 1 and all(u["prompt_tokens_details"] == {"cached_tokens": 5} for u in usages)


def test_usage_has_no_prompt_tokens_details_without_the_flag(engine, run, monkeypatch):
    monkeypatch.setattr(engine, "generate", scripted(engine, {len(engine.tokenizer.encode("a b")): 3}))

    async def go():
        async with app_client(engine) as http:
            return (await http.post("/v1/completions", json={"model": "kimi", "prompt": "a b"})).json()
    assert "prompt_tokens_details" not in run(go())["usage"]


def test_metrics_read_the_engines_prefix_cache_counters(engine, run):
    core = engine.client.core
    sched = core.engine.scheduler
    sched.prefix_cache_queries, sched.prefix_cache_hits = 1234, 567
    core.engine.output_processor.num_prompt_tokens_cached += 500

    async def go():
        async with app_client(engine, show_hidden_metrics=True) as http:
            return (await http.get("/metrics")).text
    try:
        text = run(go())
    finally:
        sched.prefix_cache_queries = sched.prefix_cache_hits = 0
        core.engine.output_processor.num_prompt_tokens_cached -= 500
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["vllm:prefix_cache_queries_total"].value == 1234
    assert samples["vllm:prefix_cache_hits_total"].value == 567
    assert samples["vllm:prompt_tokens_cached_total"].value == 500
    # --show-hidden-metrics-for-version: upstream's deprecated names, the same counters.
    assert samples["vllm:gpu_prefix_cache_queries_total"].value == 1234
    assert samples["vllm:gpu_prefix_cache_hits_total"].value == 567
    assert samples["vllm:cache_config_info"].labels["enable_prefix_caching"] == "True"


def test_reset_prefix_cache_runs_in_the_engine_between_steps(engine, run, monkeypatch):
    """The endpoint's answer is the engine's: 200 when it reset, 409 when it could not; the call runs in the
    engine loop (never during a step) and the engine serves on."""
    calls = []

    def reset() -> bool:
        calls.append(asyncio.current_task() is engine.client._task)
        return len(calls) == 1
    monkeypatch.setattr(engine.client.engine, "reset_prefix_cache", reset)

    async def go():
        async with app_client(engine) as http:
            first = await http.post("/reset_prefix_cache")
            second = await http.post("/reset_prefix_cache")
            after = await http.post("/v1/completions", json={"model": "kimi", "prompt": "def f():", "max_tokens": 2})
            return first, second, after
    first, second, after = run(go())
    assert first.status_code == 200 and calls == [True, True]
    assert second.status_code == 409 and "could not be reset" in second.json()["error"]["message"]
    assert after.status_code == 200, after.text


def test_reset_prefix_cache_resets_the_engines_cache(engine, run):
    """The real reset, through the app (needs the engine's KVCacheManager.reset_prefix_cache)."""
    async def go():
        async with app_client(engine) as http:
            return await http.post("/reset_prefix_cache")
    assert run(go()).status_code == 200


def test_request_outputs_carry_the_first_childs_cached_tokens_and_count_each_request_once(engine):
    """RequestOutput.num_cached_tokens is the prompt's (the first child's for n > 1, as upstream reports it);
    vllm:prompt_tokens_cached adds each engine request's once, at its first token."""
    from vllm.core.request import Request
    from vllm.engine.output_processor import OutputProcessor
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    processor = OutputProcessor(engine.tokenizer)
    params = SamplingParams(n=2, max_tokens=3, output_kind=RequestOutputKind.DELTA)
    children = [Request(f"p-{i}", [5] * 40, params, 3) for i in range(2)]
    children[0].num_cached_tokens, children[1].num_cached_tokens = 32, 16
    processor.add("p", None, children, params)
    for _ in range(2):
        for c in children:
            c.output_token_ids.append(7)
        [out], _, _ = processor.process(children, {})
        assert out.num_cached_tokens == 32
    assert processor.num_prompt_tokens_cached == 32 + 16
