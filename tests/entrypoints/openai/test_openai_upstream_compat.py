"""What a client written for upstream vLLM sends and expects, against `vllm serve`: unknown fields ignored (and
logged), upstream's extension fields honoured with their response fields, the extra endpoints, and upstream's
server flags."""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from vllm import LLM, SamplingParams

PROMPT = "def fibonacci(n):\n"
LONG_PROMPT = "def add(a, b):\n    return a + b\n\n" * 20  # 280 tokens
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory):
    template = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")
    return start_server("--served-model-name", "kimi-tiny", "--chat-template", str(template),
                        "--enable-server-load-tracking", "--enable-tokenizer-info-endpoint",
                        "--enable-prompt-tokens-details", "--return-tokens-as-token-ids", "-tp", "1",
                        "--enable-prefix-caching", "--disable-log-stats", "--dtype", "float", "--root-path", "/proxy",
                        "--max-logprobs", "-1",  # -1 lifts the limit, so the whole vocabulary may be asked for
                        "--trust-request-chat-template")  # a test sends its own template


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none")


@pytest.fixture(scope="module")
def greedy_reference(offline_llm):
    return offline_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]


def test_upstream_flags_start_the_server_and_say_what_they_change(server):
    err = server.stderr()
    assert "--enable-prefix-caching" not in err  # an engine flag of its own now: nothing to say about it
    assert "--disable-log-stats=True is accepted but changes nothing here" in err


def test_unknown_fields_are_ignored_and_logged(http, server):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "metadata": {"a": 1},
                                           "not_a_field": True})
    assert r.status_code == 200, r.text
    for _ in range(50):
        if "ignored: ['metadata', 'not_a_field']" in server.stderr():
            break
        time.sleep(0.1)
    assert "The following fields were present in the request but ignored: ['metadata', 'not_a_field']" \
        in server.stderr()


def test_return_token_ids_and_prompt_logprobs(http, greedy_reference):
    body = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                              "return_token_ids": True, "prompt_logprobs": 1}).json()
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == greedy_reference.prompt_token_ids
    assert choice["token_ids"] == greedy_reference.outputs[0].token_ids
    lps = choice["prompt_logprobs"]
    assert lps[0] is None and len(lps) == len(greedy_reference.prompt_token_ids)
    for tid, row in zip(greedy_reference.prompt_token_ids[1:], lps[1:]):
        assert str(tid) in row and row[str(tid)]["logprob"] <= 0
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # shorter than a block: never cached


def test_logit_bias_and_allowed_token_ids(http):
    forced = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                                "logit_bias": {"42": 100}, "return_token_ids": True}).json()
    assert forced["choices"][0]["token_ids"] == [42] * 4
    allowed = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 1.0,
                                                 "allowed_token_ids": [7, 8], "return_token_ids": True}).json()
    assert set(allowed["choices"][0]["token_ids"]) <= {7, 8}
    bad = http.post("/v1/completions", json={"prompt": PROMPT, "logit_bias": {"99999": 1}})
    assert bad.status_code == 400 and "logit_bias hold ids outside the vocabulary" in bad.json()["error"]["message"]


def test_bad_words(http, greedy_reference):
    """The greedy answer's first token, as a bad word, is never generated; a malformed list is a 400."""
    first = greedy_reference.outputs[0].token_ids[0]
    word = http.post("/detokenize", json={"tokens": [first]}).json()["prompt"]
    body = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                              "bad_words": [word], "return_token_ids": True}).json()
    assert first not in body["choices"][0]["token_ids"]
    bad = http.post("/v1/completions", json={"prompt": PROMPT, "bad_words": [""]})
    assert bad.status_code == 400 and "bad_words must be a list of non-blank strings" in bad.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_beam_search_completions_equal_offline_beam_search(http, offline_llm, stream):
    """use_beam_search with n beams returns the n beams of LLM.beam_search, best first, as choices."""
    from vllm import BeamSearchParams
    want = offline_llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))[0]
    n_prompt = len(offline_llm.llm_engine.process_prompt(PROMPT)[1])
    body = {"prompt": PROMPT, "max_tokens": 4, "n": 2, "use_beam_search": True, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        choices = [c for chunk in chunks for c in chunk["choices"] if c.get("token_ids")]
    else:
        choices = r.json()["choices"]
    assert [c["token_ids"] for c in sorted(choices, key=lambda c: c["index"])] == \
        [b.tokens[n_prompt:] for b in want.sequences]
    too_wide = http.post("/v1/completions", json={**body, "n": 11})
    assert too_wide.status_code == 400 and "beam width" in too_wide.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_beam_search_chat_equals_offline_beam_search(http, offline_llm, stream):
    """use_beam_search on chat: the n beams of LLM.beam_search over the rendered conversation, best first, as
    the choices' messages."""
    from vllm import BeamSearchParams
    body = {"messages": MESSAGES, "max_tokens": 4, "n": 2, "use_beam_search": True, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        prompt_ids = chunks[0]["prompt_token_ids"]
        choices = [c for chunk in chunks for c in chunk["choices"] if c.get("token_ids")]
    else:
        prompt_ids, choices = r.json()["prompt_token_ids"], r.json()["choices"]
    want = offline_llm.beam_search([{"prompt_token_ids": prompt_ids}],
                                   BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))[0]
    choices = sorted(choices, key=lambda c: c["index"])
    assert [c["token_ids"] for c in choices] == [b.tokens[len(prompt_ids):] for b in want.sequences]
    tok = offline_llm.get_tokenizer()
    texts = [c["delta"]["content"] if stream else c["message"]["content"] for c in choices]
    assert texts == [tok.decode(b.tokens[len(prompt_ids):], skip_special_tokens=True) for b in want.sequences]
    too_wide = http.post("/v1/chat/completions", json={**body, "n": 11, "stream": False})
    assert too_wide.status_code == 400 and "beam width" in too_wide.json()["error"]["message"]


def test_tokens_as_token_ids_by_flag_and_by_field(http):
    on = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 1,
                                            "return_token_ids": True}).json()["choices"][0]
    assert on["logprobs"]["tokens"] == [f"token_id:{t}" for t in on["token_ids"]]
    off = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 1,
                                             "return_tokens_as_token_ids": False}).json()["choices"][0]
    assert not any(t.startswith("token_id:") for t in off["logprobs"]["tokens"])


def test_truncate_prompt_tokens_keeps_the_tail(http, offline_llm):
    ids = offline_llm.get_tokenizer().encode(PROMPT * 4)
    body = http.post("/v1/completions", json={"prompt": PROMPT * 4, "max_tokens": 4, "temperature": 0,
                                              "truncate_prompt_tokens": 5, "return_token_ids": True}).json()
    assert body["choices"][0]["prompt_token_ids"] == ids[-5:]
    want = offline_llm.generate([{"prompt_token_ids": ids[-5:]}], SamplingParams(temperature=0, max_tokens=4),
                                use_tqdm=False)[0].outputs[0].token_ids
    assert body["choices"][0]["token_ids"] == want


def test_continuous_usage_stats_in_every_chunk(http):
    with http.stream("POST", "/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    with_text = [c for c in chunks if c["choices"]]
    assert with_text and all("usage" in c for c in with_text)
    counts = [c["usage"]["completion_tokens"] for c in with_text]
    assert counts == sorted(counts) and chunks[-1]["usage"]["completion_tokens"] == 5


def test_a_repeated_long_prompt_is_served_from_the_prefix_cache(http, server, read_metrics):
    """The same long prompt three times: the first leaves its blocks, the second finds them and keeps the KDA
    state where they end (docs/prefix_caching.md), the third answer's usage counts cached prompt tokens, and
    /metrics the hits. After /reset_prefix_cache, nothing of it is cached."""
    assert http.post("/reset_prefix_cache").status_code == 200
    body = {"prompt": LONG_PROMPT, "max_tokens": 2, "temperature": 0}
    first, _, third = (http.post("/v1/completions", json=body).json() for _ in range(3))
    assert first["usage"]["prompt_tokens"] >= 272  # a shared run of blocks one snapshot interval (256) long
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = third["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < third["usage"]["prompt_tokens"]
    m = read_metrics(server.url)
    assert m["vllm:prefix_cache_hits_total"] >= cached and m["vllm:prompt_tokens_cached_total"] >= cached


def test_chat_template_flag_custom_roles_extra_keys_and_template_kwargs(http, client, offline_llm):
    tpl_ids = http.post("/tokenize", json={"messages": [{"role": "critic", "content": "hi", "mood": "calm"}],
                                           "return_token_strs": True}).json()
    tok = offline_llm.get_tokenizer()
    assert tok.decode(tpl_ids["tokens"]) == "<critic>hi<assistant>"
    assert tpl_ids["token_strs"] == tok.convert_ids_to_tokens(tpl_ids["tokens"])
    kw = http.post("/tokenize", json={
        "messages": MESSAGES, "add_generation_prompt": False,
        "chat_template": "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
        "chat_template_kwargs": {"greeting": "Hello! "}}).json()
    assert tok.decode(kw["tokens"]) == "Hello! Name a colour."
    r = client.chat.completions.create(model="kimi-tiny", messages=[{"role": "narrator", "content": "x"}],
                                       max_tokens=2, extra_body={"return_token_ids": True})
    assert r.choices[0].message.role == "assistant" and len(r.model_extra["prompt_token_ids"]) > 0


def test_chat_continue_final_message_and_echo(http, offline_llm):
    messages = [*MESSAGES, {"role": "assistant", "content": "The colour is"}]
    body = http.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": 4, "temperature": 0, "add_generation_prompt": False,
        "continue_final_message": True, "echo": True, "return_token_ids": True}).json()
    tok = offline_llm.get_tokenizer()
    assert tok.decode(body["prompt_token_ids"]) == "<user>Name a colour.<assistant>The colour is"
    content = body["choices"][0]["message"]["content"]
    assert content.startswith("The colour is") and content != "The colour is"
    both = http.post("/v1/chat/completions", json={"messages": messages, "continue_final_message": True})
    assert both.status_code == 400 and "add_generation_prompt must be false" in both.json()["error"]["message"]


@pytest.mark.parametrize("body, fragment", [
    ({"response_format": {"type": "structural_tag"}}, "'structural_tag' is not supported"),
    ({"use_beam_search": True, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "use_beam_search does not combine with tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]},
     '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'),
    ({"functions": [{"name": "f"}]}, "function calling is not supported"),
])
def test_known_but_unsupported_fields_are_refused(http, body, fragment):
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
    assert r.status_code == 400 and fragment in r.json()["error"]["message"]


def test_response_format_text_and_negative_seed_are_accepted(http):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "seed": -5,
                                           "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text


def test_extra_endpoints(http, server):
    assert http.get("/openapi.json").json()["servers"] == [{"url": "/proxy"}]  # --root-path, for the proxy
    assert http.get("/v1/models/kimi-tiny").json()["id"] == "kimi-tiny"
    missing = http.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and "`gpt-4` does not exist" in missing.json()["error"]["message"]
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    assert http.get("/load").json() == {"server_load": 0}
    info = http.get("/tokenizer_info").json()
    assert info["model_max_length"] == 512 and "<assistant>" in info["chat_template"]
    chat = http.post("/invocations", json={"messages": MESSAGES, "max_tokens": 2}).json()
    assert chat["object"] == "chat.completion"
    completion = http.post("/invocations", json={"prompt": PROMPT, "max_tokens": 2}).json()
    assert completion["object"] == "text_completion"
    neither = http.post("/invocations", json={"max_tokens": 2})
    assert neither.status_code == 400 and "needs `messages`" in neither.json()["error"]["message"]
    assert http.post("/reset_prefix_cache").status_code == 200  # upstream's; through the engine core process


def test_unsupported_upstream_flags_fail_naming_them(tmp_path):
    import subprocess
    import sys
    for flags, fragment in [(["-pp", "2"], "--pipeline-parallel-size=2 is not supported by this engine"),
                            (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype='fp8' is not supported"),
                            (["--api-server-count", "0"], "--api-server-count=0 is invalid: expected 1..64"),
                            (["--quantization", "awq"], "--quantization='awq' is not supported"),
                            (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
                            (["--tool-call-parser", "hermes"], "--tool-call-parser 'hermes' is not supported"),
                            (["--reasoning-parser", "qwen3"], "--reasoning-parser 'qwen3' is not supported")]:
        r = subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--port", "0", *flags],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and fragment in r.stderr, r.stderr


def test_config_yaml_with_the_command_line_winning(start_server, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("served-model-name: from-yaml\nmax_num_seqs: 4\nenforce-eager: true\nmax-model-len: 64\n")
    s = start_server("--config", str(config))  # the fixture's --max-model-len 512 comes later: it wins
    card = httpx.get(s.url + "/v1/models").json()["data"][0]
    assert card["id"] == "from-yaml" and card["max_model_len"] == 512


def test_the_api_server_module_runs_serve():
    import subprocess
    import sys
    ok = subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--help"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "--shutdown-timeout" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "-pp", "4"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--pipeline-parallel-size=4 is not supported" in bad.stderr


def test_llm_takes_upstream_keywords_and_names_the_rest():
    llm = LLM(max_model_len=128, tensor_parallel_size=1, enable_prefix_caching=True, swap_space=4,
              enable_chunked_prefill=True)
    out = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}],
                   SamplingParams(max_tokens=2))
    assert len(out[0].outputs[0].token_ids) == 2
    assert llm.get_default_sampling_params() == SamplingParams()
    assert llm.reset_prefix_cache() is True
    with pytest.raises(ValueError, match="--pipeline-parallel-size=2 is not supported"):
        LLM(pipeline_parallel_size=2)
    with pytest.raises(ValueError, match=r"unknown engine arguments \['made_up'\]"):
        LLM(made_up=1)


def test_python_api_names():
    from vllm import AsyncEngineArgs, AsyncLLMEngine, TextPrompt, TokensPrompt
    from vllm.engine.async_llm import AsyncLLM
    from vllm.inputs import TokensPrompt as Same
    assert AsyncLLMEngine is AsyncLLM and Same is TokensPrompt
    assert AsyncEngineArgs(max_model_len=64).max_model_len == 64
    llm = LLM(max_model_len=128)
    outs = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7]), TextPrompt(prompt=PROMPT)],
                        SamplingParams(max_tokens=2), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]


def test_sigterm_drains_requests_in_flight_within_shutdown_timeout(start_server):
    s = start_server("--shutdown-timeout", "60")
    with httpx.Client(base_url=s.url, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 200, "temperature": 0,
                                                          "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            s.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in [first, *rest[:-1]]]
    assert not any("error" in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # the whole answer, not an abort
    assert s.proc.wait(30) == 0
    assert "draining: requests in flight have 60 s to finish" in Path(s.err.name).read_text()


def _cli(*args: str, stdin: str | None = None):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", *args], input=stdin,
                          capture_output=True, text=True, timeout=300)


def test_vllm_complete_and_chat_against_the_server(server):
    done = _cli("complete", "--url", server.url + "/v1", "--max-tokens", "4", "-q", PROMPT)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
    chat = _cli("chat", "--url", server.url + "/v1", "--max-tokens", "3", stdin="Hi\nAgain\n")
    assert chat.returncode == 0 and chat.stdout.count("> ") == 3, chat.stdout  # two turns, then end of input
    down = _cli("complete", "--url", "http://127.0.0.1:9/v1", "-q", "x")
    assert down.returncode == 2 and "cannot reach the server at http://127.0.0.1:9/v1" in down.stderr


def test_run_batch_answers_each_line_in_order(tmp_path, offline_llm):
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": PROMPT, "max_tokens": 5, "temperature": 0}},
             {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": MESSAGES, "max_tokens": 3}},
             {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 0}},
             {"custom_id": "d", "method": "POST", "url": "/v1/embeddings", "body": {}}]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines) + "not json\n")
    r = _cli("run-batch", "-i", str(src), "-o", str(dst), "--max-model-len", "512")
    assert r.returncode == 0 and "5 requests, 3 failed" in r.stdout, r.stderr
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["a", "b", "c", "d", None]
    want = offline_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert out[0]["response"]["body"]["choices"][0]["text"] == want.outputs[0].text and out[0]["error"] is None
    assert out[1]["response"]["body"]["object"] == "chat.completion"
    assert out[2]["response"]["status_code"] == 400 and "max_tokens must be" in out[2]["error"]["message"]
    assert "url must be POST and one of" in out[3]["error"]["message"] and out[3]["response"] is None
    assert out[4]["error"] is not None


def test_collect_env():
    r = _cli("collect-env")
    assert r.returncode == 0 and "vllm: " in r.stdout and "torch: " in r.stdout and "cuda_available: " in r.stdout


def test_vllm_bench_serve_reports_upstreams_metrics(server, tmp_path):
    r = _cli("bench", "serve", "--base-url", server.url, "--num-prompts", "4", "--random-input-len", "8",
             "--random-output-len", "4", "--ignore-eos", "--max-concurrency", "2", "--save-result", "--result-dir",
             str(tmp_path), "--result-filename", "r.json")
    assert r.returncode == 0, r.stderr
    assert "Serving Benchmark Result" in r.stdout and "Mean TTFT (ms):" in r.stdout
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 4 and result["failed"] == 0 and result["total_output_tokens"] == 16
    assert result["model_id"] == "kimi-tiny"
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"] and result["p99_itl_ms"] > 0


@pytest.mark.parametrize("kind, flags, key", [
    ("throughput", ["--num-prompts", "4", "--input-len", "8", "--output-len", "4"], "requests_per_second"),
    ("latency", ["--batch-size", "2", "--input-len", "8", "--output-len", "4", "--num-iters-warmup", "1",
                 "--num-iters", "2"], "avg_latency"),
])
def test_vllm_bench_throughput_and_latency(tmp_path, kind, flags, key):
    r = _cli("bench", kind, *flags, "--max-model-len", "128", "--output-json", str(tmp_path / "o.json"))
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "o.json").read_text())[key] > 0


def test_minus_one_means_the_whole_vocabulary(http, offline_llm):
    vocab = len(offline_llm.get_tokenizer())
    chat = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": -1,
                                                   "logprobs": True, "top_logprobs": -1}).json()
    assert all(row is None or len(row) >= vocab for row in chat["prompt_logprobs"])
    assert all(len(t["top_logprobs"]) == vocab for t in chat["choices"][0]["logprobs"]["content"])
