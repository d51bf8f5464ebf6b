"""The kimi_k2 tool-call and reasoning parsers: whole answers, and streams cut at every character (a stream must
add up to the whole answer's parse, never take back what it sent)."""
from __future__ import annotations

import json

import pytest

from vllm.entrypoints.openai.tool_parsers import get_tool_parser
from vllm.entrypoints.openai.tool_parsers.kimi_k2_tool_parser import KimiK2ToolParser, tool_call_name
from vllm.reasoning import get_reasoning_parser
from vllm.reasoning.kimi_k2_reasoning_parser import KimiK2ReasoningParser

TWO_CALLS = ('Let me check. <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
             '<|tool_call_argument_begin|>{"city": "Paris", "unit": "c"}<|tool_call_end|>'
             '<|tool_call_begin|> functions.add:1 <|tool_call_argument_begin|> {"a": 2, "b": 3} <|tool_call_end|>'
             '<|tool_calls_section_end|>')


def test_whole_answer_with_two_calls():
    out = KimiK2ToolParser.extract(TWO_CALLS)
    assert out.content == "Let me check. "
    assert [(c.id, c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("functions.get_weather:0", "get_weather", {"city": "Paris", "unit": "c"}),
        ("functions.add:1", "add", {"a": 2, "b": 3})]
    assert all(c.complete for c in out.tool_calls)


def test_no_section_is_all_content_and_singular_markers_are_read():
    assert KimiK2ToolParser.extract("just text <|tool").content == "just text <|tool"
    singular = TWO_CALLS.replace("tool_calls_section", "tool_call_section")
    assert [c.name for c in KimiK2ToolParser.extract(singular).tool_calls] == ["get_weather", "add"]


def test_names_from_ids():
    assert tool_call_name("functions.get_weather:0") == "get_weather"
    assert tool_call_name("search:12") == "search"
    assert tool_call_name("functions.ns.tool:3") == "ns.tool"


def _stream_tools(text: str, cut: int):
    stream = KimiK2ToolParser.stream()
    content, calls = "", {}
    pieces = [text[i:i + cut] for i in range(0, len(text), cut)]
    for out in [stream.feed(p) for p in pieces] + [stream.finish()]:
        content += out[0]
        for d in out[1]:
            if d.id is not None:
                assert d.index not in calls, "a call is announced once"
                calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
            calls[d.index]["arguments"] += d.arguments
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("cut", [1, 2, 3, 7, 1000])
def test_streams_add_up_to_the_whole_parse(cut):
    text = TWO_CALLS + " and after."
    whole = KimiK2ToolParser.extract(text)
    content, calls = _stream_tools(text, cut)
    assert content == whole.content == "Let me check.  and after."
    assert calls == [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in whole.tool_calls]


def test_a_stream_never_sends_a_partial_marker_as_content():
    stream = KimiK2ToolParser.stream()
    assert stream.feed("Hi <|tool_calls_sec") == ("Hi ", [])
    content, deltas = stream.feed("tion_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"x\"")
    assert content == "" and deltas[0].id == "functions.f:0" and deltas[0].arguments == '{"x"'
    content, deltas = stream.feed(": 1}<|tool_call_e")
    assert deltas[0].arguments == ": 1}" and stream.has_tool_calls


def test_unknown_parser_names_are_refused():
    assert get_tool_parser("kimi_k2") is KimiK2ToolParser
    assert get_reasoning_parser("kimi_k2") is KimiK2ReasoningParser
    with pytest.raises(ValueError, match="--tool-call-parser 'hermes' is not supported; expected one of"):
        get_tool_parser("hermes")
    with pytest.raises(ValueError, match="--reasoning-parser 'deepseek_r1' is not supported"):
        get_reasoning_parser("deepseek_r1")


@pytest.mark.parametrize("text, prompt, want", [
    ("<think>plan it</think>The answer.", "", ("plan it", "The answer.")),
    ("plan it</think>The answer.", "<|im_middle|><think>", ("plan it", "The answer.")),
    ("No thinking here.", "", (None, "No thinking here.")),
    ("A stray </think> stays.", "", (None, "A stray </think> stays.")),
    ("<think>still thinking", "", ("still thinking", None)),
    ("<think>call it<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0", "",
     ("call it", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0")),
])
def test_reasoning_split(text, prompt, want):
    assert KimiK2ReasoningParser.extract(text, prompt) == want


@pytest.mark.parametrize("cut", [1, 2, 5, 1000])
@pytest.mark.parametrize("text, prompt", [("\n<think>plan: a < b</think>\nThe answer.", ""),
                                          ("plan</think>done", "x<think>\n"), ("<thin is not a tag", "")])
def test_reasoning_streams_add_up_to_the_whole_split(cut, text, prompt):
    stream = KimiK2ReasoningParser.stream(prompt)
    reasoning = content = ""
    for out in [stream.feed(text[i:i + cut]) for i in range(0, len(text), cut)] + [stream.finish()]:
        reasoning += out[0]
        content += out[1]
    assert (reasoning or None, content or None) == KimiK2ReasoningParser.extract(text, prompt)
