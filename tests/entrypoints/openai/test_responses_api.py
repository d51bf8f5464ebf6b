"""/v1/responses with the openai client's `responses.create`: items whole and as typed stream events, tool calls
and their outputs round-tripping through `input`, `previous_response_id` continuing a stored conversation,
structured `text.format`, and what it cannot answer as 400/404s that say so.

The first tests answer from test_chat_tool_calls' script (Kimi's markers, which the built-in model cannot
write); the last ones run `vllm serve` on the built-in model."""
from __future__ import annotations

import asyncio
import json

import openai
import pytest
from test_chat_tool_calls import ANSWER, CALL, FULL, TEMPLATE, TOOLS, _client, engine  # noqa: F401

FUNCTION_TOOLS = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
                  for t in TOOLS]


def _run(engine, fn, text: str = ANSWER):  # noqa: F811 - the fixture, imported
    async def go():
        client, script = _client(engine, FULL)
        script.text = text
        return await fn(client), script
    return asyncio.run(go())


def test_thinking_text_and_call_become_items(engine):  # noqa: F811
    r, script = _run(engine, lambda c: c.responses.create(model="kimi", input="Weather in Oslo?", tools=FUNCTION_TOOLS,
                                                           instructions="Be brief."))
    assert [i.type for i in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text == "They want the weather."
    assert r.output[1].content[0].text == "Let me look." and r.output[1].role == "assistant"
    call = r.output[2]
    assert (call.call_id, call.name, json.loads(call.arguments)) == ("functions.get_weather:0", "get_weather",
                                                                      {"city": "Oslo"})
    assert r.status == "completed" and r.usage.output_tokens > 0 and r.usage.output_tokens_details.reasoning_tokens
    assert r.object == "response" and r.id.startswith("resp_")


def test_streamed_events_build_the_same_items(engine):  # noqa: F811
    async def stream(c):
        events = []
        async with await c.responses.create(model="kimi", input="Weather?", tools=FUNCTION_TOOLS, stream=True) as s:
            async for e in s:
                events.append(e)
        return events
    events, _ = _run(engine, stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert text == final.output[1].content[0].text == "Let me look."
    assert json.loads(args) == {"city": "Oslo"}
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e.output_index for e in events if e.type == "response.output_item.done"]
    assert added == done == [0, 1, 2]


def test_previous_response_and_function_output_continue_the_conversation(engine):  # noqa: F811
    async def two_turns(c):
        first = await c.responses.create(model="kimi", input="Oslo?", tools=FUNCTION_TOOLS,
                                         extra_body={"chat_template": TEMPLATE})
        call = first.output[-1]
        second = await c.responses.create(
            model="kimi", previous_response_id=first.id, tools=FUNCTION_TOOLS, extra_body={"chat_template": TEMPLATE},
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "-3 C"}])
        fetched = await c.responses.retrieve(second.id)
        return first, second, fetched
    (first, second, fetched), script = _run(engine, two_turns, text=CALL)
    assert fetched.id == second.id and fetched.output[0].call_id == second.output[0].call_id
    # The second prompt renders the stored first turn (its user message and call) and the call's output.
    assert script.prompts[1].startswith("[tool get_weather]<user>Oslo?<assistant>"
                                        '[call functions.get_weather:0 get_weather {"city": "Oslo"}]'
                                        "<tool>-3 C[result of functions.get_weather:0]<assistant>")


def test_what_cannot_be_answered_is_refused(engine):  # noqa: F811
    async def bad(c):
        errors = []
        for kwargs in ({"input": "x", "tools": [{"type": "web_search"}]},
                       {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
                       {"input": "x", "previous_response_id": "resp_nope"}):
            try:
                await c.responses.create(model="kimi", **kwargs)
            except openai.APIStatusError as e:
                errors.append((e.status_code, e.body["message"] if isinstance(e.body, dict) else str(e)))
        return errors
    errors, _ = _run(engine, bad)
    assert errors[0][0] == 400 and "only function tools" in errors[0][1]
    assert errors[1][0] == 400 and "only text parts" in errors[1][1] and "'input_image'" in errors[1][1]
    assert errors[2][0] == 404 and "'resp_nope' is not a stored response" in errors[2][1]


@pytest.fixture(scope="module")
def served(start_server):
    server = start_server()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    return client, client.models.list().data[0].id


def test_responses_on_the_built_in_model(served):
    client, model = served
    whole = client.responses.create(model=model, input="Write a haiku about the sea.", max_output_tokens=12,
                                    temperature=0)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 12 and whole.output_text
    events = list(client.responses.create(model=model, input="Write a haiku about the sea.", max_output_tokens=12,
                                          temperature=0, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].type == "response.incomplete"  # as OpenAI's stream ends when max_output_tokens cut it
    assert deltas == events[-1].response.output_text == whole.output_text
    schema = {"type": "object", "properties": {"mood": {"enum": ["calm", "stormy"]}}, "required": ["mood"],
              "additionalProperties": False}
    structured = client.responses.create(model=model, input="The sea today?", max_output_tokens=60, temperature=0,
                                         text={"format": {"type": "json_schema", "name": "sea", "schema": schema}})
    assert structured.status == "completed" and json.loads(structured.output_text)["mood"] in ("calm", "stormy")
    with client.responses.stream(model=model, input="The sea today?", max_output_tokens=60, temperature=0,
                                 text={"format": {"type": "json_schema", "name": "sea", "schema": schema}}) as s:
        final = s.get_final_response()  # the client's helper reads response.completed
    assert final.output_text == structured.output_text
    follow = client.responses.create(model=model, input="And tomorrow?", previous_response_id=structured.id,
                                     max_output_tokens=4, temperature=0)
    assert follow.usage.input_tokens > structured.usage.input_tokens + 3
