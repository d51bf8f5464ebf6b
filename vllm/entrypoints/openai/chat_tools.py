"""Tool calls and thinking in chat completions: what a request's `tools` / `tool_choice` ask of the answer, and
each choice's text turned into OpenAI's message fields (`content`, `tool_calls`, `reasoning_content`), whole or as
stream deltas.

`tool_choice`:
- "none": tools only reach the chat template (the model sees them); the answer is plain content.
- "auto" (the default with tools): the model decides; its calls are parsed out. Needs
  `--enable-auto-tool-choice --tool-call-parser NAME`, as upstream.
- a named function: the prompt ends with the model's own call header for it (tool-call section, call, function
  name, argument marker), and the answer is constrained (structured outputs) to the function's `parameters`
  schema: the arguments always parse and validate. Needs `--tool-call-parser`.
- "required": the answer is constrained to a JSON array of {"name", "parameters"} objects, one per call, each
  naming one of the tools and holding arguments of its schema (upstream's form); `parallel_tool_calls: false`
  allows exactly one. Needs `--tool-call-parser`.
A constrained answer cut by max_tokens is returned as content, with finish_reason "length".
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from vllm.entrypoints.openai.tool_parsers.kimi_k2_tool_parser import (ARGUMENT_BEGIN, CALL_BEGIN, SECTION_BEGIN,
                                                                      KimiK2ToolParser)
from vllm.reasoning.kimi_k2_reasoning_parser import KimiK2ReasoningParser


@dataclass(frozen=True, slots=True)
class ToolSettings:
    """The server's tool and reasoning flags."""
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice
    tool_parser: type[KimiK2ToolParser] | None = None  # --tool-call-parser
    reasoning_parser: type[KimiK2ReasoningParser] | None = None  # --reasoning-parser


def tool_choice_mode(tools: list[dict] | None, tool_choice: Any) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function) for a request; ValueError names what is
    malformed."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise ValueError(f'tool_choice "{tool_choice}" needs tools')
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict) and isinstance(tool_choice["function"].get("name"), str):
        name = tool_choice["function"]["name"]
        if name not in {t["function"]["name"] for t in tools or []}:
            raise ValueError(f"tool_choice names the function {name!r}, which is not among the request's tools")
        return "named", name
    raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                     f'{{"name": ...}}}}, got {tool_choice!r}')


def check_tool_settings(mode: str, settings: ToolSettings) -> None:
    """Raises ValueError (the server's 400) when the server was not started for what the request asks."""
    if mode == "auto" and not (settings.enable_auto_tool_choice and settings.tool_parser is not None):
        raise ValueError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
    if mode in ("required", "named") and settings.tool_parser is None:
        raise ValueError(f'tool_choice "{mode}" requires --tool-call-parser to be set')


def forced_prefix(mode: str, name: str | None) -> str:
    """The text a named answer starts with (see the module's docstring); "" otherwise."""
    if mode == "named":
        return f"{SECTION_BEGIN[0]}{CALL_BEGIN}functions.{name}:0{ARGUMENT_BEGIN}"
    return ""


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def tool_call_constraint(mode: str, name: str | None, tools: list[dict], parallel: bool | None) -> dict | None:
    """The structured_outputs a "required" or named answer is held to; None for "auto" and "none"."""
    # Compact JSON: the arguments are re-serialised anyway, and free whitespace only gives a weak model room
    # to wander before max_tokens.
    if mode == "named":
        return {"json": _parameters(next(t for t in tools if t["function"]["name"] == name)),
                "disable_any_whitespace": True}
    if mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "parameters": _parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if parallel is False:
        schema["maxItems"] = 1
    return {"json": schema, "disable_any_whitespace": True}


class ConstrainedCalls:
    """The tool calls of a constrained answer (tool_call_constraint): the arguments of the named function, or
    the array of calls. Streamed, the calls come whole in the last delta, once the answer parsed."""

    def __init__(self, mode: str, name: str | None) -> None:
        self.mode, self.name, self.text, self.has_tool_calls = mode, name, "", False

    def calls(self, text: str) -> list[tuple[str, str]] | None:
        """(name, arguments) of each call; None when the text is not a whole answer (cut by max_tokens)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.mode == "named":
            return [(self.name, json.dumps(value, ensure_ascii=False))] if isinstance(value, dict) else None
        if not isinstance(value, list) or not all(isinstance(c, dict) and "name" in c for c in value):
            return None
        return [(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in value]

    def message(self, text: str) -> dict:
        calls = self.calls(text)
        if calls is None:
            return {"content": text}
        self.has_tool_calls = True
        return {"content": None, "tool_calls": [openai_tool_call(None, f"functions.{n}:{i}", n, args)
                                                for i, (n, args) in enumerate(calls)]}

    def delta(self, text: str, final: bool) -> dict:
        self.text += text
        if not final:
            return {}
        message = self.message(self.text)
        if "tool_calls" not in message:
            return {"content": self.text} if self.text else {}
        return {"tool_calls": [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]}


def openai_tool_call(index: int | None, call_id: str | None, name: str | None, arguments: str) -> dict:
    """One entry of `tool_calls` (whole: index None) or of a delta's `tool_calls` (id and name only first)."""
    out: dict = {} if index is None else {"index": index}
    function: dict = {"arguments": arguments}
    if call_id is not None:
        out.update(id=call_id, type="function")
        function = {"name": name, **function}
    return {**out, "function": function}


class ChoiceParser:
    """One choice of one request: its text split into thinking, content and tool calls."""

    def __init__(self, settings: ToolSettings, parse_tools: bool, prompt_text: str, prefix: str,
                 constrained: ConstrainedCalls | None = None) -> None:
        self.constrained = constrained  # a "required" or named answer: its text is only its calls
        self.tools = settings.tool_parser if parse_tools else None
        self.reasoning = settings.reasoning_parser
        self.prompt_text, self.prefix = prompt_text, prefix
        self.tool_stream = self.tools.stream() if self.tools else None
        self.reasoning_stream = self.reasoning.stream(prompt_text) if self.reasoning and not prefix else None
        self.primed = False

    @property
    def active(self) -> bool:
        return self.tools is not None or self.reasoning is not None or self.constrained is not None

    def message(self, text: str) -> dict:
        """The whole answer's message fields; `tool_calls` present only when the model called tools."""
        if self.constrained is not None:
            return self.constrained.message(text)
        text = self.prefix + text
        reasoning, content = (self.reasoning.extract(text, self.prompt_text) if self.reasoning and not self.prefix
                              else (None, text))
        out: dict = {"content": content}
        if self.tools is not None and content:
            extracted = self.tools.extract(content)
            if extracted.tool_calls:
                out["content"] = extracted.content or None
                out["tool_calls"] = [openai_tool_call(None, c.id, c.name, c.arguments) for c in extracted.tool_calls]
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        return out

    def delta(self, text: str, final: bool) -> dict:
        """The delta fields for the next piece of a stream (`final`: the answer ended; flush what was held)."""
        if self.constrained is not None:
            return self.constrained.delta(text, final)
        if not self.primed and self.prefix:
            text, self.primed = self.prefix + text, True
        reasoning, content = self._fed(self.reasoning_stream, text, final) if self.reasoning_stream else ("", text)
        out: dict = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        if self.tool_stream is None:
            if content:
                out["content"] = content
            return out
        plain, calls = self._fed(self.tool_stream, content, final)
        if plain:
            out["content"] = plain
        if calls:
            out["tool_calls"] = [openai_tool_call(d.index, d.id, d.name, d.arguments) for d in calls]
        return out

    @staticmethod
    def _fed(stream, text: str, final: bool) -> tuple:
        """What `text` adds, and at the end also what the stream held back."""
        first = stream.feed(text)
        if not final:
            return first
        rest = stream.finish()
        return (first[0] + rest[0], first[1] + rest[1])

    @property
    def called_tools(self) -> bool:
        if self.constrained is not None:
            return self.constrained.has_tool_calls
        return self.tool_stream is not None and self.tool_stream.has_tool_calls
