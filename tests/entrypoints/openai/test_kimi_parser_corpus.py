"""A corpus of Kimi answers as models really write them, well-formed or not (missing, repeated and truncated
markers; thinking that never closes; calls begun inside the thinking; the reports behind them: vllm#53246,
vllm#56850, sglang#34604), through the kimi_k2 tool and reasoning parsers as the server chains them: reasoning
first, then tool calls in what is content. Each answer is parsed whole and streamed in pieces of every size,
which must add up to the whole parse."""
from __future__ import annotations

import json

import pytest

from vllm.entrypoints.openai.tool_parsers.kimi_k2_tool_parser import KimiK2ToolParser
from vllm.reasoning.kimi_k2_reasoning_parser import KimiK2ReasoningParser

S, E = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
B, A, Z = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
WEATHER = B + "functions.get_weather:0" + A + '{"city": "Oslo"}' + Z
TIME = B + "functions.get_time:1" + A + '{"tz": "CET"}' + Z

# (answer, prompt, want reasoning, want content, want calls [(id, name, arguments or None if not JSON)])
CORPUS = {
    "well-formed": ("<think>need weather</think>Checking." + S + WEATHER + E, "",
                    "need weather", "Checking.", [("functions.get_weather:0", "get_weather", {"city": "Oslo"})]),
    "think never closed before the calls (vllm#53246)": (
        "<think>need weather" + S + WEATHER + TIME + E, "", "need weather", "",
        [("functions.get_weather:0", "get_weather", {"city": "Oslo"}), ("functions.get_time:1", "get_time",
                                                                         {"tz": "CET"})]),
    "prompt opened the thinking, no close": ("need weather" + S + WEATHER + E, "<|im_middle|><think>",
                                             "need weather", "", [("functions.get_weather:0", "get_weather",
                                                                   {"city": "Oslo"})]),
    "cut mid-think by max_tokens (vllm#56850)": ("<think>first I will look at the", "", "first I will look at the",
                                                 "", []),
    "no section begin marker": ("Checking." + WEATHER + E, "", None, "Checking.",
                                [("functions.get_weather:0", "get_weather", {"city": "Oslo"})]),
    "bare call inside the thinking": ("<think>need weather" + WEATHER, "", "need weather", "",
                                      [("functions.get_weather:0", "get_weather", {"city": "Oslo"})]),
    "no section markers at all, text after": ("Checking." + WEATHER + " Done.", "", None, "Checking. Done.",
                                              [("functions.get_weather:0", "get_weather", {"city": "Oslo"})]),
    "section end replaces the call end": ("Checking." + S + WEATHER.removesuffix(Z) + E + " Done.", "", None,
                                          "Checking. Done.", [("functions.get_weather:0", "get_weather",
                                                              {"city": "Oslo"})]),
    "two sections": ("One." + S + WEATHER + E + " Two." + S + TIME + E, "", None, "One. Two.",
                     [("functions.get_weather:0", "get_weather", {"city": "Oslo"}),
                      ("functions.get_time:1", "get_time", {"tz": "CET"})]),
    "section begin repeated": ("x" + S + S + WEATHER + E, "", None, "x",
                               [("functions.get_weather:0", "get_weather", {"city": "Oslo"})]),
    "truncated inside the arguments": ("Checking." + S + B + "functions.get_weather:0" + A + '{"city": "Os', "",
                                       None, "Checking.", [("functions.get_weather:0", "get_weather", None)]),
    "truncated inside the call header": ("Checking." + S + B + "functions.get_wea", "", None, "Checking.", []),
    "singular section markers": ("<think>t</think>" + S.replace("calls", "call") + WEATHER + E.replace("calls", "call"),
                                 "", "t", "", [("functions.get_weather:0", "get_weather", {"city": "Oslo"})]),
    "id without the functions prefix": ("" + S + B + "get_weather:3" + A + '{"city": "Oslo"}' + Z + E, "", None, "",
                                        [("get_weather:3", "get_weather", {"city": "Oslo"})]),
    "stray close tag without thinking": ("A stray </think> is content.", "", None, "A stray </think> is content.",
                                         []),
}


def parse_whole(text: str, prompt: str):
    reasoning, content = KimiK2ReasoningParser.extract(text, prompt)
    tools = KimiK2ToolParser.extract(content or "")
    return reasoning, tools.content, [(c.id, c.name, c.arguments) for c in tools.tool_calls]


def parse_streamed(text: str, prompt: str, cut: int):
    think, tools = KimiK2ReasoningParser.stream(prompt), KimiK2ToolParser.stream()
    reasoning, content, calls = "", "", {}
    pieces = [text[i:i + cut] for i in range(0, len(text), cut)]
    outs = [think.feed(p) for p in pieces] + [think.finish()]
    tool_outs = [tools.feed(c) for _, c in outs] + [tools.finish()]
    for r, _ in outs:
        reasoning += r
    for c, deltas in tool_outs:
        content += c
        for d in deltas:
            if d.id is not None:
                assert d.index not in calls, "a call is announced once"
                calls[d.index] = [d.id, d.name, ""]
            calls[d.index][2] += d.arguments
    return reasoning or None, content, [tuple(calls[i]) for i in sorted(calls)]


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


@pytest.mark.parametrize("name", list(CORPUS))
def test_corpus_whole(name):
    text, prompt, want_reasoning, want_content, want_calls = CORPUS[name]
    reasoning, content, calls = parse_whole(text, prompt)
    assert reasoning == want_reasoning
    assert content == want_content
    assert [(i, n, _json_or_none(a)) for i, n, a in calls] == want_calls


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 8, 1000])
@pytest.mark.parametrize("name", list(CORPUS))
def test_corpus_streamed_adds_up(name, cut):
    text, prompt, *_ = CORPUS[name]
    assert parse_streamed(text, prompt, cut) == parse_whole(text, prompt)
