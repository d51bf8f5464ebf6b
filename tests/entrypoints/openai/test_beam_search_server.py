"""Beam search on a real server: refused like a plain request past --max-model-len, length_penalty and list
limits as 400s naming the field, logprobs returned when asked. (A client that leaves: in process, in
tests/entrypoints/test_beam_search_limits.py, where the engine's own request count can be read.)"""
from __future__ import annotations

import time

import httpx
import pytest

from vllm.sampling_params import MAX_STOP_TOKEN_IDS

PROMPT = "def add(a, b):"
BEAM = {"prompt": PROMPT, "use_beam_search": True, "n": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server(start_server):
    return start_server()  # --max-model-len 512


def post(server, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=timeout)


def chat(body: dict) -> dict:
    out = {k: v for k, v in body.items() if k != "prompt"}
    return {**out, "messages": [{"role": "user", "content": PROMPT}]}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_max_tokens_past_max_model_len_is_a_400_as_for_a_plain_request(server, path):
    body = {**BEAM, "max_tokens": 600}
    body = chat(body) if "chat" in path else body
    plain = post(server, path, {**body, "use_beam_search": False, "n": 1})
    start = time.monotonic()
    beam = post(server, path, body, timeout=30)
    assert time.monotonic() - start < 10
    assert plain.status_code == beam.status_code == 400, beam.text
    assert beam.json()["error"]["message"] == plain.json()["error"]["message"]
    assert "--max-model-len (512)" in beam.json()["error"]["message"]


@pytest.mark.parametrize("field, value", [("length_penalty", 1e5), ("length_penalty", 1e308),
                                          ("length_penalty", -1e308),
                                          ("stop_token_ids", [1] * (MAX_STOP_TOKEN_IDS + 1)),
                                          ("stop", ["x"] * 65)])
def test_out_of_range_fields_are_400s_naming_them(server, field, value):
    r = post(server, "/v1/completions", {**BEAM, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and r.json()["error"]["message"].startswith(f"{field} must")


def test_logprobs_are_returned_for_beams(server):
    r = post(server, "/v1/completions", {**BEAM, "max_tokens": 3, "logprobs": 1, "echo": True}).json()
    for choice in r["choices"]:
        lp = choice["logprobs"]
        assert lp is not None and len(lp["tokens"]) == len(lp["token_logprobs"]) > 3  # the prompt's and 3 more
        assert lp["token_logprobs"][0] is None and all(x is not None for x in lp["token_logprobs"][1:])
        assert all(len(top) <= 2 for top in lp["top_logprobs"][1:])  # the chosen token and the top 1
        assert "".join(lp["tokens"]) == choice["text"]
    c = post(server, "/v1/chat/completions", chat({**BEAM, "max_tokens": 3, "logprobs": True,
                                                   "top_logprobs": 2})).json()
    for choice in c["choices"]:
        content = choice["logprobs"]["content"]
        assert len(content) == 3 and all(len(t["top_logprobs"]) == 2 for t in content)
        assert content[0]["top_logprobs"][0]["logprob"] >= content[0]["top_logprobs"][1]["logprob"]
