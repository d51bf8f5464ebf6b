"""Structured outputs through `vllm serve` with the openai client: response_format json_schema / json_object,
structured_outputs and upstream's guided_* fields, whole and streamed; tool_choice "required" and named held to
the tools' schemas; malformed constraints as 400s that name the problem; a constraint longer than max_tokens ends
with "length" while other requests are served."""
from __future__ import annotations

import asyncio
import json
import re

import openai
import pytest

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer",
                                                                                   "maximum": 99}},
          "required": ["answer", "n"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}, "days": {"type": "integer", "minimum": 1,
                                                                                "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--tool-call-parser", "kimi_k2")


@pytest.fixture(scope="module")
def client(server):
    global MODEL
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    MODEL = c.models.list().data[0].id
    return c


MODEL = ""


def valid(value: dict) -> bool:
    return set(value) == {"answer", "n"} and value["answer"] in ("yes", "no") and isinstance(value["n"], int)


def test_json_schema_response_format_whole_and_streamed(server, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt,
                                           max_tokens=200, temperature=0)
    assert whole.choices[0].finish_reason == "stop", whole.choices[0].message.content
    assert valid(json.loads(whole.choices[0].message.content))
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt,
                                            max_tokens=200, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content


def test_json_object_and_structured_outputs_on_both_endpoints(server, client):
    obj = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=120,
                                         response_format={"type": "json_object"}, temperature=0.8, seed=3, n=2)
    for c in obj.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
        else:
            assert c.message.content.lstrip().startswith("{")
    choice = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=10, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["blue", "green", "on fire"]}})
    assert choice.choices[0].text in ("blue", "green", "on fire") and choice.choices[0].finish_reason == "stop"
    regex = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=20, temperature=0,
                                      extra_body={"guided_regex": r"\+47 [0-9]{8}"})
    assert re.fullmatch(r"\+47 [0-9]{8}", regex.choices[0].text)
    grammar = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"grammar": 'root ::= ("yes" | "no") "." '}})
    assert grammar.choices[0].message.content in ("yes.", "no.")


@pytest.mark.parametrize("parallel", [None, False])
def test_required_tool_choice_gives_calls_that_validate(server, client, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                       tool_choice="required", temperature=0.7, seed=1, n=3, **extra)
    # Unbounded arrays let the tiny model call again and again: such a choice is cut ("length", as content).
    finished = [c for c in r.choices if c.finish_reason == "tool_calls"]
    assert finished if parallel is False else True
    for c in r.choices:
        if c.finish_reason == "length":
            assert c.message.content.startswith('[{"name": "get_') and not c.message.tool_calls
            continue
        assert c.finish_reason == "tool_calls", c.message.content
        assert c.message.tool_calls and (parallel is None or len(c.message.tool_calls) == 1)
        for call in c.message.tool_calls:
            args = json.loads(call.function.arguments)
            if call.function.name == "get_weather":
                assert args["city"] in ("Oslo", "Rome") and 1 <= args["days"] <= 7 and len(args) == 2
            else:
                assert call.function.name == "get_time" and args == {"zone": args["zone"]}
                assert args["zone"] in ("UTC", "CET")


def test_named_tool_choice_arguments_validate(server, client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=100,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["city"] in ("Oslo", "Rome") and 1 <= args["days"] <= 7


@pytest.mark.parametrize("body,fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     'structured_outputs.json is not valid: Unsupported type "nonsense"'),
    ({"extra_body": {"structured_outputs": {"regex": "(ab"}}}, "structured_outputs.regex is not valid"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= undefined_rule"}}},
     'Rule "undefined_rule" is not defined'),
    ({"extra_body": {"structured_outputs": {"choice": "yes"}}}, "must be a non-empty list of strings"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}},
     "give one output constraint, got response_format, guided_regex"),
    ({"response_format": {"type": "structural_tag"}}, "'structural_tag' is not supported"),
    ({"response_format": {"type": "json_schema"}}, "needs json_schema.schema"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     'tool_choice "required" constrains the answer to tool calls'),
])
def test_malformed_constraints_are_400s_that_name_the_problem(server, client, body, fragment):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, **body)
    assert fragment in e.value.body["message"] if isinstance(e.value.body, dict) else fragment in str(e.value)


def test_a_constraint_longer_than_max_tokens_ends_with_length_beside_other_requests(server, client):
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x")

    async def go():
        long = aclient.completions.create(model=MODEL, prompt="x", max_tokens=6, temperature=0,
                                          extra_body={"structured_outputs": {"regex": "(ab){50}"}})
        plain = [aclient.completions.create(model=MODEL, prompt=f"Count {i}:", max_tokens=8,
                                            temperature=0) for i in range(3)]
        return await asyncio.gather(long, *plain)
    long, *plain = asyncio.run(go())
    assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == 6
    assert re.fullmatch(r"(ab)*a?", long.choices[0].text)
    assert all(p.choices[0].finish_reason == "length" and p.usage.completion_tokens == 8 for p in plain)
