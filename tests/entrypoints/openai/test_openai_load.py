"""64 concurrent streams, a quarter of them hanging up mid-stream: the rest finish with the offline greedy text,
the leavers' requests are aborted (not run to max_tokens), and afterwards every block and state slot is free."""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from vllm import SamplingParams

N_REQUESTS, N_LEAVERS = 64, 16
MAX_TOKENS, LEAVER_MAX_TOKENS = 24, 480


@pytest.fixture(scope="module")
def server(start_server):
    return start_server()


async def _stream(client: httpx.AsyncClient, prompt: str, max_tokens: int, leave_after: int | None
                  ) -> tuple[str, bool]:
    """(text received, whether the stream ended with [DONE]); hangs up after `leave_after` events if set."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": leave_after is not None}
    text, events = "", 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return text, True
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
            events += 1
            if leave_after is not None and events >= leave_after:
                return text, False  # leaving the block closes the connection mid-stream
    return text, False


def _wait_all_free(url: str, read_metrics, free_blocks: float, free_slots: float, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(url)
        idle = (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
                and m["vllm:num_free_blocks"] == free_blocks and m["vllm:num_free_state_slots"] == free_slots)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_concurrent_streams_with_disconnects(server, offline_llm, read_metrics):
    rng = random.Random(0)
    prompts = [f"Story {i}: once upon a time there was a" for i in range(N_REQUESTS)]
    leavers = set(rng.sample(range(N_REQUESTS), N_LEAVERS))
    leave_after = {i: rng.randint(1, 10) for i in leavers}
    stayers = [i for i in range(N_REQUESTS) if i not in leavers]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    expected = {i: o.outputs[0].text for i, o in zip(stayers, offline_llm.generate(
        [prompts[i] for i in stayers], greedy, use_tqdm=False))}
    before = read_metrics(server.url)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     limits=httpx.Limits(max_connections=N_REQUESTS)) as client:
            return await asyncio.gather(*(
                _stream(client, prompts[i], LEAVER_MAX_TOKENS if i in leavers else MAX_TOKENS, leave_after.get(i))
                for i in range(N_REQUESTS)))
    start = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - start

    for i in stayers:
        assert results[i] == (expected[i], True), f"request {i}"
    assert all(not results[i][1] for i in leavers)
    after = _wait_all_free(server.url, read_metrics, before["vllm:num_free_blocks"],
                           before["vllm:num_free_state_slots"])
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0 and after["vllm:state_slot_usage_perc"] == 0
    assert after["vllm:num_free_blocks"] == before["vllm:num_free_blocks"]
    assert after["vllm:num_free_state_slots"] == before["vllm:num_free_state_slots"]
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    # Aborted leavers stop early: far below what running them to LEAVER_MAX_TOKENS would generate.
    assert len(stayers) * MAX_TOKENS < generated < len(stayers) * MAX_TOKENS + N_LEAVERS * LEAVER_MAX_TOKENS // 4
    # Latency histograms count the requests that finished, not the ones whose client left.
    assert after["vllm:e2e_request_latency_seconds_count"] - before["vllm:e2e_request_latency_seconds_count"] \
        == len(stayers)
    assert elapsed < 120, f"64 short streams took {elapsed:.1f} s"  # about 3 s on an idle 2-core box
    good = httpx.post(server.url + "/v1/completions", json={"prompt": prompts[stayers[0]], "max_tokens":
                      MAX_TOKENS, "temperature": 0}, timeout=60)
    assert good.json()["choices"][0]["text"] == expected[stayers[0]]


def test_non_streaming_client_that_leaves_is_aborted(server, read_metrics):
    before = read_metrics(server.url)
    body = {"prompt": "Once upon a time", "max_tokens": LEAVER_MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
    after = _wait_all_free(server.url, read_metrics, before["vllm:num_free_blocks"],
                           before["vllm:num_free_state_slots"])
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < LEAVER_MAX_TOKENS
