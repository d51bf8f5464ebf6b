"""Behaviour that upstream vLLM's own OpenAI-server tests check, rewritten in our words against `vllm serve`
(benchmarks/upstream_server_tests/README.md tells of the measurement that found these): an empty `model`, the
--max-logprobs limit, the seed's range and the error type in messages, the keys of whole answers (prompt_logprobs
and OpenAI's empty fields), continuous usage only with usage, /tokenize's token_strs, upstream's prompt error
texts, the key behind --root-path, and the metrics upstream's dashboards read."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from vllm.version import _prev_minor_version, _prev_minor_version_was

KEY = "k-123"
PROMPT = "def fibonacci(n):\n"
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--served-model-name", "kimi-tiny", "--api-key", KEY, "--root-path", "/llm",
                        "--show-hidden-metrics-for-version", _prev_minor_version())


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def test_empty_model_name_means_the_served_model(http):
    for path, body in [("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MESSAGES})]:
        r = http.post(path, json={**body, "model": "", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "kimi-tiny"
    assert http.post("/v1/completions", json={"prompt": PROMPT, "model": "other"}).status_code == 404


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
])
def test_whole_vocabulary_needs_a_max_logprobs_that_covers_it(http, path, body, field):
    """With the default --max-logprobs (20), -1 (4096 tokens here) is over the limit: a 400 naming the field."""
    r = http.post(path, json={**body, "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field
    assert "whole vocabulary" in error["message"] and "--max-logprobs" in error["message"]
    ok = http.post(path, json={**body, field: 3, "logprobs": True} if field == "top_logprobs" else
                   {**body, field: 3, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("seed, error_type", [(2**63, "less_than_equal"), (-(2**63) - 1, "greater_than_equal")])
def test_seed_is_a_signed_64_bit_integer(http, seed, error_type):
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "seed": seed})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "seed" and f"[type={error_type}]" in r.json()["error"]["message"]
    edge = 2**63 - 1 if seed > 0 else -(2**63)
    assert http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2,
                                                   "seed": edge}).status_code == 200


def test_prompt_logprobs_is_null_unless_asked_for(http):
    """Clients read `prompt_logprobs` off every answer (the openai client raises on a missing attribute)."""
    completion = http.post("/v1/completions", json={"prompt": [PROMPT, PROMPT], "max_tokens": 2}).json()
    assert [c["prompt_logprobs"] for c in completion["choices"]] == [None, None]
    chat = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}).json()
    assert "prompt_logprobs" in chat and chat["prompt_logprobs"] is None
    asked = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2,
                                                    "prompt_logprobs": 1}).json()
    assert asked["prompt_logprobs"][0] is None and len(asked["prompt_logprobs"]) > 1


def test_whole_answers_have_the_keys_of_the_openai_clients_models(server, http):
    """What the openai client parses equals the raw JSON: no key of OpenAI's models is missing (upstream's
    /invocations tests compare the two), the empty ones null (tool_calls an empty list)."""
    client = openai.OpenAI(base_url=server.url + "/llm/v1", api_key=KEY)
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    parsed = client.completions.create(model="kimi-tiny", **body).model_dump()
    raw = http.post("/v1/completions", json=body).json()
    assert parsed.keys() == raw.keys() and parsed["choices"][0].keys() == raw["choices"][0].keys()
    assert raw["system_fingerprint"] is None
    body = {"messages": MESSAGES, "max_tokens": 3, "temperature": 0}
    parsed = client.chat.completions.create(model="kimi-tiny", **body).model_dump()
    raw = http.post("/v1/chat/completions", json=body).json()
    assert parsed["choices"] == raw["choices"]
    assert raw["service_tier"] is None and raw["system_fingerprint"] is None
    message = raw["choices"][0]["message"]
    assert message["tool_calls"] == [] and message["refusal"] is None and message["function_call"] is None


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": PROMPT}),
                                        ("/v1/chat/completions", {"messages": MESSAGES})])
def test_continuous_usage_only_adds_to_included_usage(http, path, body):
    """As upstream: continuous_usage_stats without include_usage sends no usage at all."""
    def chunks(options):
        with http.stream("POST", path, json={**body, "max_tokens": 3, "stream": True,
                                             "stream_options": options}) as r:
            return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all(c.get("usage") is None for c in chunks({"include_usage": False, "continuous_usage_stats": True}))
    both = chunks({"include_usage": True, "continuous_usage_stats": True})
    assert all(c["usage"]["total_tokens"] > 0 for c in both) and both[-1]["choices"] == []


def test_tokenize_add_special_tokens_defaults_by_input(http):
    """The BOS is added to a prompt unless turned off, and to messages (rendered by the chat template, which
    writes its own markers) only when asked for."""
    bos = http.post("/tokenize", json={"prompt": "x"}).json()["tokens"][0]
    assert http.post("/tokenize", json={"prompt": "x", "add_special_tokens": False}).json()["tokens"][0] != bos
    plain = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert plain[0] != bos
    assert http.post("/tokenize", json={"messages": MESSAGES, "add_special_tokens": True}).json()["tokens"] == \
        [bos, *plain]


def test_tokenize_always_has_token_strs(http):
    plain = http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert "token_strs" in plain and plain["token_strs"] is None
    asked = http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert asked["tokens"] == plain["tokens"] and len(asked["token_strs"]) == len(plain["tokens"])


@pytest.mark.parametrize("prompt, fragment", [
    ("", "the decoder prompt cannot be empty"),
    ([[]], "the decoder prompt cannot be empty"),
    ([5, 4096], "token id 4096 is out of vocabulary"),
    ([[1, 2], [999999]], "prompt[1]: token id 999999 is out of vocabulary"),
])
def test_prompt_errors_use_upstreams_words(http, prompt, fragment):
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert fragment in r.json()["error"]["message"]


def test_api_key_guards_v1_behind_the_root_path_too(server):
    """A proxy may forward /llm/v1/... as it came: the key must be checked there as on /v1/..."""
    for prefix in ("", "/llm"):
        url = f"{server.url}{prefix}/v1/models"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
        good = httpx.get(url, headers={"Authorization": f"Bearer {KEY}"})
        assert good.status_code == 200 and good.json()["data"][0]["id"] == "kimi-tiny"


def test_prefix_cache_and_hidden_metrics(http, server, read_metrics):
    http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    m = read_metrics(server.url)
    hits = m["vllm:prefix_cache_hits_total"]
    assert 0 <= m["vllm:prompt_tokens_cached_total"] <= hits <= m["vllm:prefix_cache_queries_total"]
    # --show-hidden-metrics-for-version with the previous minor version: the deprecated names as well.
    assert m["vllm:gpu_cache_usage_perc"] == m["vllm:kv_cache_usage_perc"]
    assert m["vllm:gpu_prefix_cache_queries_total"] == m["vllm:prefix_cache_queries_total"]
    assert m["vllm:gpu_prefix_cache_hits_total"] == hits


def test_hidden_metrics_stay_hidden_by_default(start_server, read_metrics):
    other = start_server("--show-hidden-metrics-for-version", "0.9")
    m = read_metrics(other.url)
    assert "vllm:kv_cache_usage_perc" in m and "vllm:prefix_cache_queries_total" in m
    assert "vllm:gpu_cache_usage_perc" not in m
    assert f"whose hidden metrics were deprecated in {_prev_minor_version()}" in other.stderr()


def test_prev_minor_version():
    assert _prev_minor_version() == "0.0"
    assert _prev_minor_version_was("0.0") and _prev_minor_version_was("0.0.3")
    assert not _prev_minor_version_was("0.1") and not _prev_minor_version_was("0.10")


def test_get_tokenizer_takes_upstreams_fast_mode():
    """Upstream's tests load their reference tokenizer with tokenizer_mode="fast": the same as "auto" here."""
    import vllm
    from vllm.transformers_utils.tokenizer import get_tokenizer
    path = f"{vllm.__path__[0]}/assets/default_model"
    assert get_tokenizer(path, tokenizer_mode="fast").encode(PROMPT) == get_tokenizer(path).encode(PROMPT)
    with pytest.raises(ValueError, match="expected auto, hf, slow or fast"):
        get_tokenizer(path, tokenizer_mode="mistral")
