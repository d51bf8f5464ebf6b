"""Kimi K2's tool-call format (`--tool-call-parser kimi_k2`), whole and streamed.

The model writes its calls after any plain content, as special tokens around text:

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>
    ...
    <|tool_calls_section_end|>

A call's id is `functions.NAME:IDX` (the chat template writes it back into tool-call history as is), its name
the part between `functions.` and the index, and its arguments the JSON text between the argument marker and the
call's end, passed on as the model wrote it (OpenAI's `arguments` is a string). Some Kimi checkpoints spell the
section markers in the singular (`<|tool_call_section_begin|>`); both are read. Text after the section is
content again. Real output also omits the section's begin marker, writes a second section, or ends the
section without the last call's end marker (tests/entrypoints/openai/test_kimi_parser_corpus.py): all are read.

The markers are special tokens, so a request parsed here must be detokenized with skip_special_tokens=False.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.utils import partial_marker_len

SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
SECTION_STARTS = (*SECTION_BEGIN, CALL_BEGIN)


@dataclass(slots=True)
class ToolCall:
    id: str  # functions.NAME:IDX
    name: str
    arguments: str  # JSON text, as written
    complete: bool = True  # False: its end marker has not come (yet)


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of the index-th call of a stream: its id and name once (with the first piece), then arguments."""
    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class ExtractedToolCalls:
    content: str  # the text outside the tool-call section
    tool_calls: list[ToolCall] = field(default_factory=list)


def tool_call_name(call_id: str) -> str:
    """`functions.get_weather:0` -> `get_weather` (ids without the prefix or the index are read too)."""
    head = call_id.rsplit(":", 1)[0] if ":" in call_id else call_id
    return head.removeprefix("functions.")


def _find_first(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str] | None:
    found = [(i, m) for m in markers if (i := text.find(m, start)) >= 0]
    return min(found) if found else None


def _next_section(text: str, start: int) -> tuple[int, str, int | None] | None:
    """(where the next tool-call section starts, its body, where the text resumes after its end marker or None
    if it is still open). A call begun without a section marker (seen in real output) opens a section itself."""
    first = _find_first(text, SECTION_STARTS, start)
    if first is None:
        return None
    i, marker = first
    body = i + len(marker) if marker in SECTION_BEGIN else i
    end = _find_first(text, SECTION_END, body)
    return (i, text[body:], None) if end is None else (i, text[body:end[0]], end[0] + len(end[1]))


def _calls(section: str, closed: bool, final: bool) -> list[ToolCall]:
    calls = []
    for piece in section.split(CALL_BEGIN)[1:]:
        if ARGUMENT_BEGIN not in piece:
            continue  # its header is still being written (or the model never wrote one)
        call_id, arguments = piece.split(ARGUMENT_BEGIN, 1)
        call_id = call_id.strip()
        complete = CALL_END in arguments
        if complete:
            arguments = arguments.split(CALL_END, 1)[0]
        elif not closed and not final:
            arguments = arguments[:len(arguments) - partial_marker_len(arguments, (CALL_END, *SECTION_END))]
        # Stripped while streaming too: whitespace that is trailing now is sent once text follows it.
        arguments = arguments.strip()
        calls.append(ToolCall(call_id, tool_call_name(call_id), arguments, complete))
    return calls


def parse(text: str, final: bool) -> tuple[str, list[ToolCall]]:
    """(content, calls) of the text so far. Unless `final`, content omits a possible section marker's start at
    its end, and an unfinished call's arguments a partial marker and whitespace that may turn out to be
    trailing, so that what is reported never has to be taken back. Several sections (text between them is
    content), sections opened by a bare call marker, and calls whose end marker the section's end replaces
    are all read."""
    content, calls, pos = [], [], 0
    while (section := _next_section(text, pos)) is not None:
        start, body, resume = section
        content.append(text[pos:start])
        calls += _calls(body, closed=resume is not None, final=final)
        if resume is None:
            # An answer that ends with its section still open (its end marker never came): text after the last
            # call's end is content, if no call follows it.
            last = body.rfind(CALL_END)
            if final and last >= 0 and CALL_BEGIN not in body[last:]:
                content.append(body[last + len(CALL_END):])
            return "".join(content), calls
        pos = resume
    tail = text[pos:]
    held = 0 if final else partial_marker_len(tail, SECTION_STARTS)
    content.append(tail[:len(tail) - held])
    return "".join(content), calls


class KimiK2ToolParser:
    """Upstream's `kimi_k2` tool parser: `extract` reads a whole answer, `stream` returns a per-request parser
    of deltas."""

    name = "kimi_k2"
    markers = (*SECTION_BEGIN, *SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)

    @staticmethod
    def extract(text: str) -> ExtractedToolCalls:
        content, calls = parse(text, final=True)
        return ExtractedToolCalls(content, calls)

    @staticmethod
    def stream() -> KimiK2ToolStream:
        return KimiK2ToolStream()


class KimiK2ToolStream:
    """One streamed answer: `feed` each text delta, get back the new content and tool-call pieces; `finish`
    flushes what was held back (a marker's possible start, whitespace) at the end of the answer."""

    def __init__(self) -> None:
        self.text = ""
        self.content_sent = 0
        self.arguments_sent: list[int] = []  # per announced call

    @property
    def has_tool_calls(self) -> bool:
        return bool(self.arguments_sent)

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        self.text += delta
        return self._emit(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return self._emit(final=True)

    def _emit(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        content, calls = parse(self.text, final)
        new_content = content[self.content_sent:]
        self.content_sent = max(self.content_sent, len(content))
        deltas = []
        for i, call in enumerate(calls):
            if i == len(self.arguments_sent):
                self.arguments_sent.append(0)
                deltas.append(ToolCallDelta(i, "", id=call.id, name=call.name))
            piece = call.arguments[self.arguments_sent[i]:]
            if piece:
                self.arguments_sent[i] = len(call.arguments)
                if deltas and deltas[-1].index == i:
                    deltas[-1].arguments += piece
                else:
                    deltas.append(ToolCallDelta(i, piece))
        # Content before the tool-call section can never change once sent: drop it, so that each delta re-reads
        # only the held-back tail and the section, not the whole answer.
        begin = _find_first(self.text, SECTION_STARTS)
        cut = min(self.content_sent, begin[0]) if begin else self.content_sent
        self.text, self.content_sent = self.text[cut:], self.content_sent - cut
        return new_content, deltas
