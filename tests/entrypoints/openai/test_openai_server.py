"""`vllm serve` end to end: completions and chat through the openai client, streamed and not, against offline
`LLM` outputs; usage, logprobs, tokenize/detokenize, models, version and metrics."""
from __future__ import annotations

import httpx
import openai
import pytest

from vllm import SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time", "Q: What is two plus two?\nA:"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--served-model-name", "kimi-tiny", "other-name")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(offline_llm):
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return {"completions": [o.outputs[0] for o in offline_llm.generate(PROMPTS, greedy, use_tqdm=False)],
            "chat": offline_llm.chat(MESSAGES, greedy, use_tqdm=False)[0]}


def test_greedy_completions_equal_offline(client, offline):
    out = client.completions.create(model="kimi-tiny", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert out.object == "text_completion" and out.model == "kimi-tiny"
    assert [c.index for c in out.choices] == [0, 1, 2]
    for choice, ref in zip(out.choices, offline["completions"]):
        assert choice.text == ref.text and choice.finish_reason == ref.finish_reason
    assert out.usage.completion_tokens == sum(len(r.token_ids) for r in offline["completions"])
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_streamed_completion_concatenates_to_the_whole_text(client, offline):
    chunks = list(client.completions.create(model="kimi-tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline["completions"][0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert len(chunks) > 3  # really streamed, not one chunk


def test_streamed_n_and_several_prompts_match_the_whole_answer(client):
    kw = {"model": "kimi-tiny", "prompt": PROMPTS[:2], "max_tokens": 8, "temperature": 0.9, "seed": 3, "n": 2}
    whole = client.completions.create(**kw)
    texts = ["" for _ in range(4)]
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in whole.choices]


def test_token_id_prompts_and_usage(client, server, offline_llm):
    ids = offline_llm.get_tokenizer().encode(PROMPTS[1])
    out = client.completions.create(model="kimi-tiny", prompt=[ids, ids[:3]], max_tokens=5, temperature=0)
    assert out.usage.prompt_tokens == len(ids) + 3 and out.usage.completion_tokens == 10
    by_text = client.completions.create(model="kimi-tiny", prompt=PROMPTS[1], max_tokens=5, temperature=0)
    assert out.choices[0].text == by_text.choices[0].text


def test_n_seed_and_echo(client):
    kw = {"model": "kimi-tiny", "prompt": PROMPTS[:2], "max_tokens": 6, "temperature": 1.0, "seed": 7, "n": 3}
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == list(range(6))
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices[:3]}) > 1  # the n samples differ
    echo = client.completions.create(model="kimi-tiny", prompt=PROMPTS[0], max_tokens=3, temperature=0, echo=True)
    assert echo.choices[0].text.startswith(PROMPTS[0])


def test_completion_logprobs_legacy_format(client):
    out = client.completions.create(model="kimi-tiny", prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and top[token] == logprob and 3 <= len(top) <= 4
        assert logprob == max(top.values())  # greedy picks the most likely token
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]


def test_echo_logprobs_offsets_index_the_text(client):
    out = client.completions.create(model="kimi-tiny", prompt=PROMPTS[0], max_tokens=2, temperature=0, logprobs=1,
                                    echo=True)
    text, lp = out.choices[0].text, out.choices[0].logprobs
    assert lp.tokens[0] == "<bos>" and lp.token_logprobs[0] is None and lp.text_offset[:2] == [0, 0]
    for token, offset in list(zip(lp.tokens, lp.text_offset))[1:]:  # the ASCII prompt: every token is in place
        if offset < len(PROMPTS[0]):
            assert text[offset:offset + len(token)] == token


def test_stop_strings_and_stream_hold_back(client):
    whole = client.completions.create(model="kimi-tiny", prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0)
    text = whole.choices[0].text
    stop = text[3:5]  # a string that greedy decoding is known to produce
    cut = client.completions.create(model="kimi-tiny", prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="kimi-tiny", prompt=PROMPTS[2], max_tokens=MAX_TOKENS,
                                         temperature=0, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_chat_equals_offline_chat(client, offline):
    out = client.chat.completions.create(model="other-name", messages=MESSAGES, max_tokens=MAX_TOKENS,
                                         temperature=0)
    ref = offline["chat"]
    assert out.object == "chat.completion" and out.model == "kimi-tiny"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.outputs[0].text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_chat_stream_and_logprobs(client, offline):
    chunks = list(client.chat.completions.create(model="kimi-tiny", messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True, logprobs=True, top_logprobs=2,
                                                 stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == offline["chat"].outputs[0].text
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == MAX_TOKENS
    for e in entries:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token  # greedy: the top token
        assert e.logprob == e.top_logprobs[0].logprob and bytes(e.bytes).decode() == e.token
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_startup_line_names_the_address(server):
    assert f"serving kimi-tiny, other-name on {server.url}" in server.stdout()


def test_models_version_tokenize(server, client, offline_llm, offline):
    assert [m.id for m in client.models.list().data] == ["kimi-tiny", "other-name"]
    assert httpx.get(server.url + "/version").json()["version"]
    tok = httpx.post(server.url + "/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert tok["tokens"] == offline_llm.get_tokenizer().encode(PROMPTS[0]) and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 512
    detok = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"][1:]}).json()
    assert detok["prompt"] == PROMPTS[0]
    chat_tok = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat_tok["tokens"] == offline["chat"].prompt_token_ids


def test_metrics_parse_and_move(server, client, read_metrics):
    before = read_metrics(server.url)
    client.completions.create(model="kimi-tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0)
    after = read_metrics(server.url)
    assert after["vllm:prompt_tokens_total"] > before["vllm:prompt_tokens_total"]
    assert after["vllm:generation_tokens_total"] == before["vllm:generation_tokens_total"] + 5
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert after[f"vllm:{h}_count"] == before[f"vllm:{h}_count"] + 1
    assert after["vllm:inter_token_latency_seconds_count"] == before["vllm:inter_token_latency_seconds_count"] + 4
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0
    # Upstream's per-request histograms: one observation each, with the request's sizes.
    for h in ("queue", "prefill", "decode", "inference"):
        assert after[f"vllm:request_{h}_time_seconds_count"] == before[f"vllm:request_{h}_time_seconds_count"] + 1
    assert after["vllm:request_generation_tokens_sum"] == before["vllm:request_generation_tokens_sum"] + 5
    assert after["vllm:request_params_max_tokens_sum"] == before["vllm:request_params_max_tokens_sum"] + 5
    assert after["vllm:time_per_output_token_seconds_count"] == before["vllm:time_per_output_token_seconds_count"] + 1
    # Engine steps: a prefill of the prompt and 4 decode steps (the 5th token comes from the prefill); as upstream
    # counts them, the prompt's tokens plus the 5 generated ones.
    assert after["vllm:iteration_tokens_total_count"] == before["vllm:iteration_tokens_total_count"] + 5
    assert after["vllm:iteration_tokens_total_sum"] - before["vllm:iteration_tokens_total_sum"] == \
        after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] + 5
    assert after["vllm:cache_config_info"] == 1 and "vllm:num_preemptions_total" in after


def test_openai_client_sees_errors_as_exceptions(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_model_len|max-model-len"):
        client.completions.create(model="kimi-tiny", prompt="x", max_tokens=10_000)
