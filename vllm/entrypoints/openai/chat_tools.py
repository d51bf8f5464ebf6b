"""Tool calls and thinking in chat completions: what a request's `tools` / `tool_choice` ask of the answer, and
each choice's text turned into OpenAI's message fields (`content`, `tool_calls`, `reasoning_content`), whole or as
stream deltas.

`tool_choice`:
- "none": tools only reach the chat template (the model sees them); the answer is plain content.
- "auto" (the default with tools): the model decides; its calls are parsed out. Needs
  `--enable-auto-tool-choice --tool-call-parser NAME`, as upstream.
- "required" / a named function: this engine has no guided decoding, so the answer is made to start with the
  tool-call section (and, for a named function, that function's call header). The prompt ends with that prefix
  and the parser reads it before the model's text, so the call is announced even before its arguments come.
  Needs `--tool-call-parser`.
"""
from __future__ import annotations

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
    """The text a "required" or named answer starts with (see the module's docstring); "" otherwise."""
    if mode == "required":
        return SECTION_BEGIN[0] + CALL_BEGIN
    if mode == "named":
        return f"{SECTION_BEGIN[0]}{CALL_BEGIN}functions.{name}:0{ARGUMENT_BEGIN}"
    return ""


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

    def __init__(self, settings: ToolSettings, parse_tools: bool, prompt_text: str, prefix: str) -> None:
        self.tools = settings.tool_parser if parse_tools else None
        self.reasoning = settings.reasoning_parser
        self.prompt_text, self.prefix = prompt_text, prefix
        self.tool_stream = self.tools.stream() if self.tools else None
        self.reasoning_stream = self.reasoning.stream(prompt_text) if self.reasoning and not prefix else None
        self.primed = False

    @property
    def active(self) -> bool:
        return self.tools is not None or self.reasoning is not None

    def message(self, text: str) -> dict:
        """The whole answer's message fields; `tool_calls` present only when the model called tools."""
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
        return self.tool_stream is not None and self.tool_stream.has_tool_calls
