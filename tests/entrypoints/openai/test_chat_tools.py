"""Chat tool calling glue: tool_choice modes and their server flags, the forced prefix of "required" and named
choices, and each choice's text as OpenAI message fields, whole and streamed (a stream adds up to the whole)."""
from __future__ import annotations

import json

import pytest

from vllm.entrypoints.openai.chat_tools import (ChoiceParser, ToolSettings, check_tool_settings, forced_prefix,
                                                tool_choice_mode)
from vllm.entrypoints.openai.tool_parsers.kimi_k2_tool_parser import KimiK2ToolParser
from vllm.reasoning.kimi_k2_reasoning_parser import KimiK2ReasoningParser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
BOTH = ToolSettings(True, KimiK2ToolParser, KimiK2ReasoningParser)
ANSWER = ('<think>The user wants weather.</think>Checking.<|tool_calls_section_begin|><|tool_call_begin|>'
          'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>'
          '<|tool_calls_section_end|>')


@pytest.mark.parametrize("tools, choice, want", [
    (None, None, ("none", None)), (TOOLS, None, ("auto", None)), (TOOLS, "none", ("none", None)),
    (TOOLS, "required", ("required", None)),
    (TOOLS, {"type": "function", "function": {"name": "get_weather"}}, ("named", "get_weather"))])
def test_tool_choice_modes(tools, choice, want):
    assert tool_choice_mode(tools, choice) == want


@pytest.mark.parametrize("tools, choice, fragment", [
    (None, "auto", '"auto" needs tools'), (None, "required", '"required" needs tools'),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "'nope', which is not among the request's tools"),
    (TOOLS, "sometimes", 'tool_choice must be "none", "auto", "required"')])
def test_malformed_tool_choices_are_named(tools, choice, fragment):
    with pytest.raises(ValueError, match=fragment):
        tool_choice_mode(tools, choice)


def test_modes_need_their_server_flags():
    with pytest.raises(ValueError, match="requires --enable-auto-tool-choice and --tool-call-parser"):
        check_tool_settings("auto", ToolSettings(False, KimiK2ToolParser))
    with pytest.raises(ValueError, match='"named" requires --tool-call-parser'):
        check_tool_settings("named", ToolSettings())
    check_tool_settings("none", ToolSettings())
    check_tool_settings("auto", BOTH)


def test_whole_message_splits_thinking_content_and_calls():
    msg = ChoiceParser(BOTH, True, "<|im_assistant|>assistant<|im_middle|>", "").message(ANSWER)
    assert msg["reasoning_content"] == "The user wants weather."
    assert msg["content"] == "Checking."
    assert msg["tool_calls"] == [{"id": "functions.get_weather:0", "type": "function",
                                  "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]


def test_tool_choice_none_leaves_calls_in_the_content():
    msg = ChoiceParser(BOTH, False, "", "").message(ANSWER)
    assert "tool_calls" not in msg and msg["content"].startswith("Checking.<|tool_calls_section_begin|>")


def test_named_choice_reads_its_forced_prefix():
    prefix = forced_prefix("named", "get_weather")
    msg = ChoiceParser(BOTH, True, "", prefix).message('{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|>')
    assert msg["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [{"city": "Rome"}]


@pytest.mark.parametrize("cut", [1, 4, 1000])
def test_stream_deltas_add_up_to_the_whole_message(cut):
    parser = ChoiceParser(BOTH, True, "", "")
    pieces = [ANSWER[i:i + cut] for i in range(0, len(ANSWER), cut)]
    deltas = [parser.delta(p, final=False) for p in pieces] + [parser.delta("", final=True)]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            if "id" in c:
                calls[c["index"]] = {"id": c["id"], "type": "function",
                                     "function": {"name": c["function"]["name"], "arguments": ""}}
            calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    whole = ChoiceParser(BOTH, True, "", "").message(ANSWER)
    assert (reasoning, content, list(calls.values())) == (whole["reasoning_content"], whole["content"],
                                                          whole["tool_calls"])
    assert parser.called_tools
