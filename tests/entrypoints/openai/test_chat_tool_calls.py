"""Tool calls and thinking through /v1/chat/completions with the openai client, whole and streamed.

The built-in model cannot write Kimi's tool-call tokens, so its engine's `generate` is replaced by a script:
each request's answer is a fixed text, sent in small deltas. Everything else is the server's own path (the app
in process): request validation, tools through the chat template, the forced prefix of named and "required"
choices, the parsers, the response shape. The prompts each request produced are kept for the tests to read.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm import AsyncLLM
from vllm.entrypoints.openai.api_server import build_app
from vllm.entrypoints.openai.chat_tools import ToolSettings
from vllm.entrypoints.openai.serving_engine import ServerSettings
from vllm.entrypoints.openai.tool_parsers.kimi_k2_tool_parser import KimiK2ToolParser
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.reasoning.kimi_k2_reasoning_parser import KimiK2ReasoningParser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CALL = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
        '{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>')
ANSWER = "<think>They want the weather.</think>Let me look." + CALL
# A conversation with a tool call and its result, as the openai client sends it back (content null).
HISTORY = [{"role": "user", "content": "Oslo?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "functions.get_weather:0", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
           {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "-3 C"}]
# A template that shows what reached it: the tools, each message's tool calls and tool results.
TEMPLATE = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
            "{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }} {{ c.function.arguments }}]"
            "{% endfor %}{% if m.tool_call_id %}[result of {{ m.tool_call_id }}]{% endif %}{% endfor %}"
            "<assistant>")


class Script:
    """Stands in for the engine's generate: answers `text` in 5-character deltas, records each prompt."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine, self.text, self.prompts, self.params = engine, ANSWER, [], []

    async def generate(self, prompt, params, request_id):
        ids = prompt["prompt_token_ids"]
        self.prompts.append(self.engine.tokenizer.decode(ids))
        self.params.append(params)
        pieces = [self.text[i:i + 5] for i in range(0, len(self.text), 5)]
        for k, piece in enumerate(pieces):
            await asyncio.sleep(0)
            last = k == len(pieces) - 1
            yield RequestOutput(request_id, None, ids, None, [CompletionOutput(0, piece, [7], None, None,
                                                                               "stop" if last else None)], last)


@pytest.fixture(scope="module")
def engine():
    return AsyncLLM.from_engine_args(EngineArgs(max_model_len=512), multiprocess=False)


def _client(engine, tools: ToolSettings) -> tuple[openai.AsyncOpenAI, Script]:
    script = Script(engine)
    # The tests send their template with each request, as a trusted client may.
    app = build_app(engine, ServerSettings(served_model_names=["kimi"], log_requests=False, tools=tools,
                                           trust_request_chat_template=True))
    engine.generate = script.generate  # the module's engine: each test's app answers from its own script
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http), script


FULL = ToolSettings(True, KimiK2ToolParser, KimiK2ReasoningParser)


def test_auto_tool_call_with_thinking_whole(engine):
    async def go():
        client, script = _client(engine, FULL)
        r = await client.chat.completions.create(model="kimi", messages=[{"role": "user", "content": "Oslo?"}],
                                                 tools=TOOLS, extra_body={"chat_template": TEMPLATE})
        return r, script
    r, script = asyncio.run(go())
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    assert choice.message.model_extra["reasoning_content"] == "They want the weather."
    call = choice.message.tool_calls[0]
    assert (call.id, call.type, call.function.name, json.loads(call.function.arguments)) == \
        ("functions.get_weather:0", "function", "get_weather", {"city": "Oslo"})
    assert "[tool get_weather]" in script.prompts[0]  # the tools reached the template
    assert script.params[0].skip_special_tokens is False  # the markers stay in the text


def test_streamed_deltas_add_up(engine):
    async def go():
        client, _ = _client(engine, FULL)
        stream = await client.chat.completions.create(model="kimi", messages=[{"role": "user", "content": "?"}],
                                                      tools=TOOLS, stream=True)
        return [chunk async for chunk in stream]
    chunks = asyncio.run(go())
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert reasoning == "They want the weather." and content == "Let me look."
    assert calls[0].id == "functions.get_weather:0" and calls[0].function.name == "get_weather"
    assert all(tc.index == 0 for tc in calls) and sum(tc.id is not None for tc in calls) == 1
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"city": "Oslo"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tool_call_history_reaches_the_template(engine):
    messages = HISTORY

    async def go():
        client, script = _client(engine, FULL)
        script.text = "It is -3 C."
        r = await client.chat.completions.create(model="kimi", messages=messages, tools=TOOLS,
                                                 extra_body={"chat_template": TEMPLATE})
        return r, script
    r, script = asyncio.run(go())
    assert r.choices[0].message.content == "It is -3 C." and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    prompt = script.prompts[0]
    assert '[call functions.get_weather:0 get_weather {"city": "Oslo"}]' in prompt
    assert "<tool>-3 C[result of functions.get_weather:0]" in prompt


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["named", "required", "required_single"])
def test_forced_choices_are_constrained_to_the_tools_schemas(engine, choice, stream):
    """A named choice: the prompt ends with the call's header and the answer is held to the function's parameters;
    "required": to an array of {name, parameters} calls (one with parallel_tool_calls false). The answers the
    constraint allows become tool_calls whole and streamed; the script writes what the grammar would allow."""
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    extra = {"parallel_tool_calls": False} if choice == "required_single" else {}

    async def go():
        client, script = _client(engine, ToolSettings(False, KimiK2ToolParser))  # no auto: not needed here
        script.text = ('{"city": "Rome"}' if choice == "named" else
                       '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
        r = await client.chat.completions.create(model="kimi", messages=[{"role": "user", "content": "?"}],
                                                 tools=TOOLS, tool_choice=tool_choice, stream=stream, **extra)
        if not stream:
            return r.choices[0].message.tool_calls, r.choices[0].finish_reason, script
        calls, finish = {}, None
        async for chunk in r:
            for d in chunk.choices[0].delta.tool_calls or []:
                calls.setdefault(d.index, {"name": d.function.name, "arguments": ""})
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        return [c for _, c in sorted(calls.items())], finish, script
    calls, finish, script = asyncio.run(go())
    header = "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    assert script.prompts[0].endswith(header) == (choice == "named")
    schema = script.params[0].structured_outputs.json
    parameters = TOOLS[0]["function"]["parameters"]
    if choice == "named":
        assert schema == parameters
    else:
        assert schema["items"]["anyOf"][0]["properties"] == {"name": {"const": "get_weather"},
                                                             "parameters": parameters}
        assert schema.get("maxItems") == (1 if choice == "required_single" else None)
    names = [c.function.name if not stream else c["name"] for c in calls]
    args = [json.loads(c.function.arguments if not stream else c["arguments"]) for c in calls]
    assert names == ["get_weather"] and args == [{"city": "Rome"} if choice == "named" else {"city": "Oslo"}]
    assert finish == "tool_calls"


def test_tool_choice_none_answers_plain_content(engine):
    async def go():
        client, script = _client(engine, FULL)
        script.text = "Plain."
        return await client.chat.completions.create(model="kimi", messages=[{"role": "user", "content": "?"}],
                                                    tools=TOOLS, tool_choice="none")
    r = asyncio.run(go())
    assert r.choices[0].message.content == "Plain." and not r.choices[0].message.tool_calls


@pytest.mark.parametrize("tools, body, fragment", [
    (ToolSettings(), {"tools": TOOLS}, "requires --enable-auto-tool-choice and --tool-call-parser"),
    (FULL, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "'nope', which is not among the request's tools"),
    (FULL, {"tool_choice": "required"}, '"required" needs tools'),
])
def test_bad_tool_requests_are_400s_that_say_why(engine, tools, body, fragment):
    async def go():
        client, _ = _client(engine, tools)
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="kimi", messages=[{"role": "user", "content": "?"}], **body)
        return e.value
    err = asyncio.run(go())
    assert fragment in str(err)


def test_null_content_history_renders_with_the_builtin_template(engine):
    """An assistant turn with `content: null` and tool calls (what the openai client sends back) renders with the
    built-in template, which concatenates message['content']: the content is "", as upstream has it."""
    messages = HISTORY

    async def go():
        client, script = _client(engine, FULL)
        script.text = "It is -3 C."
        return await client.chat.completions.create(model="kimi", messages=messages, tools=TOOLS), script
    r, script = asyncio.run(go())
    assert r.choices[0].message.content == "It is -3 C."
    assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\n-3 C<|im_end|>" in script.prompts[0]


def test_llm_chat_takes_null_content():
    from vllm.entrypoints.llm import text_content
    msg = {"role": "assistant", "content": None, "tool_calls": [{"id": "a"}]}
    assert text_content(msg) == {**msg, "content": ""} and text_content({"role": "user"})["content"] == ""
