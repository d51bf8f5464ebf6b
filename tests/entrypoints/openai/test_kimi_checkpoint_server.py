"""`vllm serve DIR --trust-remote-code` on a checkpoint laid out as the published Kimi ones: the remote-code
tokenizer and chat_template.jinja over HTTP, generation_config.json's defaults for the fields a request leaves
unset, `--generation-config vllm` and `--chat-template` overriding them."""
from __future__ import annotations

import json

import httpx
import pytest
from kimi_checkpoint import write_kimi_checkpoint

from vllm.entrypoints.cli.main import build_parser
from vllm.transformers_utils.tokenizer import get_tokenizer

GENERATION = {"temperature": 0.0, "max_new_tokens": 5, "eos_token_id": [305, 308]}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory) -> str:
    return write_kimi_checkpoint(tmp_path_factory.mktemp("kimi"), generation_config=GENERATION)


@pytest.fixture(scope="module")
def server(start_server, kimi_dir):
    return start_server(kimi_dir, "--trust-remote-code")


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json={"model": server.args[0], **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_serve_parses_the_flags():
    args = build_parser().parse_args(["serve", "/some/dir", "--trust-remote-code", "--generation-config", "vllm"])
    assert args.model_tag == "/some/dir" and args.trust_remote_code is True and args.generation_config == "vllm"
    args = build_parser().parse_args(["serve", "/some/dir"])
    assert args.trust_remote_code is False and args.generation_config == "auto"


def test_without_trust_remote_code_the_server_says_which_flag(start_server, kimi_dir):
    with pytest.raises(RuntimeError, match="pass --trust-remote-code"):
        start_server(kimi_dir)


def test_completion_defaults_come_from_generation_config(server):
    """No max_tokens: the file's 5 (not OpenAI's 16); no temperature: the file's greedy 0.0."""
    body = {"prompt": "hello world", "ignore_eos": True}
    first, second = post(server, "/v1/completions", body), post(server, "/v1/completions", body)
    assert first["usage"]["completion_tokens"] == 5
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    explicit = post(server, "/v1/completions", {**body, "max_tokens": 3, "temperature": 0.0})
    assert explicit["usage"]["completion_tokens"] == 3
    greedy = post(server, "/v1/completions", {**body, "max_tokens": 5, "temperature": 0.0})
    assert greedy["choices"][0]["text"] == first["choices"][0]["text"]


def test_chat_uses_the_template_and_the_defaults(server, kimi_dir):
    tok = get_tokenizer(kimi_dir, trust_remote_code=True)
    out = post(server, "/v1/chat/completions", {"messages": MESSAGES, "ignore_eos": True})
    assert out["usage"]["prompt_tokens"] == len(tok.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                                        tokenize=True)["input_ids"])
    assert out["usage"]["completion_tokens"] == 5
    out = post(server, "/v1/chat/completions", {"messages": MESSAGES, "ignore_eos": True,
                                                "max_completion_tokens": 2})
    assert out["usage"]["completion_tokens"] == 2


def test_generation_config_vllm_and_chat_template_override(start_server, kimi_dir, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[BOS]{{ m['content'] }}{% endfor %}")
    server = start_server(kimi_dir, "--trust-remote-code", "--generation-config", "vllm",
                          "--chat-template", str(template))
    out = post(server, "/v1/completions", {"prompt": "hello world", "ignore_eos": True})
    assert out["usage"]["completion_tokens"] == 16  # OpenAI's default for completions
    tok = get_tokenizer(kimi_dir, trust_remote_code=True)
    ids = post(server, "/tokenize", {"messages": MESSAGES})["tokens"]
    assert ids == tok.encode("[BOS]hi")


def test_tool_calls_through_serve_on_the_kimi_checkpoint(start_server, kimi_dir):
    """The tool flags on `vllm serve`: a named tool_choice makes the answer start inside that function's call (the
    prompt ends with the call's header, in the tokenizer's own special tokens) and holds it to the function's
    parameters, so whatever the tiny model prefers, the response carries the call with arguments that parse.
    Without tool_choice the model's own answer comes back as a message."""
    import openai
    server = start_server(kimi_dir, "--trust-remote-code", "--enable-auto-tool-choice", "--tool-call-parser",
                          "kimi_k2", "--reasoning-parser", "kimi_k2")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    named = client.chat.completions.create(
        model=server.args[0], messages=MESSAGES, tools=tools, max_tokens=16,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = named.choices[0].message.tool_calls[0]
    assert (call.id, call.function.name) == ("functions.get_weather:0", "get_weather")
    assert json.loads(call.function.arguments) == {}  # the only object {"type": "object"} allows in strict mode
    tok = get_tokenizer(kimi_dir, trust_remote_code=True)
    header = tok.encode("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                        "<|tool_call_argument_begin|>", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(header)[0] == "<|tool_calls_section_begin|>"  # one special token
    plain = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert named.usage.prompt_tokens == len(plain) + len(header)
    auto = client.chat.completions.create(model=server.args[0], messages=MESSAGES, tools=tools, max_tokens=4)
    assert auto.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert auto.usage.completion_tokens <= 4
