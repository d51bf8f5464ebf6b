"""Kimi K2's thinking (`--reasoning-parser kimi_k2`): the text up to `</think>` is `reasoning_content`, the rest
`content`, whole and streamed.

An answer thinks when it opens with `<think>`, or when its prompt ends with `<think>` (a chat template that opens
the thinking for the model): then everything up to `</think>` is reasoning. A tool-call section begun before
`</think>` ends the thinking there; the calls are content, for the tool parser. An answer that does not think
is all content, a stray `</think>` included.
"""
from __future__ import annotations

from vllm.utils import partial_marker_len

THINK_BEGIN, THINK_END = "<think>", "</think>"
# A call begun without its section marker ends the thinking too (as real output does it; the tool parser reads it).
TOOL_SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>", "<|tool_call_begin|>")


def prompt_opens_thinking(prompt: str) -> bool:
    return prompt.rstrip().endswith(THINK_BEGIN)


def split_reasoning(text: str, thinking: bool, final: bool) -> tuple[str, str] | None:
    """(reasoning, content) of the answer so far; `thinking`: the prompt opened it. Unless `final`, a possible
    marker's start at the end of the reasoning is held back, and None means it cannot be told yet (the answer so
    far may be the start of `<think>`)."""
    stripped = text.lstrip()
    if stripped.startswith(THINK_BEGIN):  # opened by the answer (again, if the prompt did too)
        thinking, text = True, stripped[len(THINK_BEGIN):]
    elif not thinking and not final and THINK_BEGIN.startswith(stripped):
        return None
    if not thinking:
        return "", text
    ends = [(i, m) for m in (THINK_END, *TOOL_SECTION_BEGIN) if (i := text.find(m)) >= 0]
    if ends:
        i, marker = min(ends)
        # </think> itself belongs to neither part; a tool section is content.
        return text[:i], text[i + len(marker):] if marker == THINK_END else text[i:]
    held = 0 if final else partial_marker_len(text, (THINK_END, *TOOL_SECTION_BEGIN))
    return text[:len(text) - held], ""


class KimiK2ReasoningParser:
    """Upstream's `kimi_k2` reasoning parser: `extract` splits a whole answer, `stream` returns a per-request
    splitter of deltas. `prompt` is the rendered prompt, which may have opened the thinking."""

    name = "kimi_k2"

    @staticmethod
    def extract(text: str, prompt: str = "") -> tuple[str | None, str | None]:
        """(reasoning_content, content), None where empty (OpenAI's absent field)."""
        reasoning, content = split_reasoning(text, prompt_opens_thinking(prompt), final=True)
        return reasoning or None, content or None

    @staticmethod
    def stream(prompt: str = "") -> KimiK2ReasoningStream:
        return KimiK2ReasoningStream(prompt_opens_thinking(prompt))


class KimiK2ReasoningStream:
    def __init__(self, thinking: bool) -> None:
        self.thinking = thinking
        self.text = ""
        self.reasoning_sent = 0
        # Once any content came, the thinking is over (or never began): every later delta is content as it is.
        self.in_content = False

    def feed(self, delta: str) -> tuple[str, str]:
        """(new reasoning, new content) after this delta."""
        if self.in_content:
            return "", delta
        self.text += delta
        return self._emit(final=False)

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the answer."""
        return ("", "") if self.in_content else self._emit(final=True)

    def _emit(self, final: bool) -> tuple[str, str]:
        split = split_reasoning(self.text, self.thinking, final)
        if split is None:
            return "", ""
        reasoning, content = split
        new = reasoning[self.reasoning_sent:], content
        self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
        if content:
            self.in_content, self.text = True, ""
        return new
