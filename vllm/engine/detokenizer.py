"""Incremental detokenization of one request's generated tokens, with stop strings.

Each step decodes only a small window of token ids: the tokens of the previous emitted chunk (context, so that
tokenizers whose text depends on the neighbouring token stay right) plus the new ones, and keeps the part of the
window's text past the context. Cost per step depends on the chunk sizes, not on how long the output already is.

A request that nobody reads mid-way (FINAL_ONLY, as LLM.generate asks) and that has no stop string needs no
text until it finishes: its ids are only collected, and the text is one decode when it is read. At 256 running
requests that was most of the output processor's host time per step.
"""
from __future__ import annotations

from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.transformers_utils.tokenizer import decoder_for

# Prompt tokens used as context for the first generated token (upstream uses the same number).
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's generated token ids into text, step by step, and stops at the first stop string.

    Invariant until a stop string matches: output_text == decode(generated ids).rstrip("\\ufffd"); a trailing
    incomplete (or invalid) UTF-8 sequence is held back until a complete character follows it. Byte-level BPE
    splits multi-byte characters across tokens, so a window that ends mid-character decodes to a trailing U+FFFD.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.decode_ids = decoder_for(tokenizer)
        self.params = params
        self.stop: list[str] = list(params.stop or [])
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        # Streaming holds back this many trailing chars: they could still turn into (the start of) a stop string
        # that would be cut. When the stop string is kept in the output there is nothing to hide.
        self.stop_buffer_length = 0 if params.include_stop_str_in_output else max(self.max_stop_len - 1, 0)
        self.stop_reason: str | None = None  # the stop string that matched, once one did
        self._text = ""
        self._last_output_offset = 0  # chars of output_text already returned by delta calls
        self._ids: list[int] = []  # context ids, then every generated id
        self._prefix_offset = 0  # the decode window starts here in _ids
        self._read_offset = 0  # ids before this are fully turned into output text
        self._read_chars = 0  # chars of the window's decoded text already in output_text
        # Text only when read (module docstring); the generated ids start at _generated_from in _ids.
        self._lazy = params.output_kind is RequestOutputKind.FINAL_ONLY and not self.stop
        self._stale = False
        self._generated_from = 0
        if not params.detokenize:
            return
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        context_text = self._decode(context) if context else ""
        if context_text.endswith(_REPLACEMENT):
            # The prompt ends mid-character: its bytes would merge with the first generated ones, and the output
            # must be the decode of the generated ids alone.
            context, context_text = [], ""
        self._ids = context
        self._read_offset = len(context)
        self._read_chars = len(context_text)
        self._generated_from = len(context)

    @property
    def output_text(self) -> str:
        if self._stale:
            # The invariant of the class, computed in one decode.
            self._text = self._decode(self._ids[self._generated_from:]).rstrip(_REPLACEMENT)
            self._stale = False
        return self._text

    def _decode(self, ids: list[int]) -> str:
        return self.decode_ids(ids, self.params.skip_special_tokens)

    def _decode_new(self) -> str:
        """Text that the ids added since the last call complete, as upstream's detokenize_incrementally does."""
        text = self._decode(self._ids[self._prefix_offset:])
        if text.endswith(_REPLACEMENT):
            # Everything before the trailing replacement chars ends on a complete character, so it is final
            # already; the window is not moved, so the held-back bytes are decoded again with what follows.
            stable = text.rstrip(_REPLACEMENT)
            new = stable[self._read_chars:]
            self._read_chars += len(new)
            return new
        new = text[self._read_chars:]
        if new:
            # The window ends on a complete character: the chunk just read becomes the next window's context.
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._read_chars = len(self._decode(self._ids[self._prefix_offset:self._read_offset]))
        return new

    def update(self, new_token_ids: list[int], check_stop: bool = True) -> str | None:
        """Append tokens; returns the stop string that matched (then output_text is truncated at it, keeping
        it only if params.include_stop_str_in_output), else None. With check_stop False (min_tokens not reached
        yet) no stop string is matched; later checks find only matches that end in text added by then."""
        if not self.params.detokenize or self.stop_reason is not None or not new_token_ids:
            return None
        self._ids.extend(new_token_ids)
        if self._lazy:
            self._stale = True
            return None
        new = self._decode_new()
        if not new:
            return None
        start = len(self._text)
        self._text += new
        return self._check_stop(start) if check_stop else None

    def _check_stop(self, start: int) -> str | None:
        """Search the new text (from start) plus the overlap a stop string begun earlier could need."""
        if not self.stop:
            return None
        lo = max(start - (self.max_stop_len - 1), 0)
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            i = self._text.find(s, lo)
            # Earliest start wins; on a tie the shorter one, which would have completed first token by token.
            if i >= 0 and (best is None or (i, len(s)) < best[:2]):
                best = (i, len(s), s)
        if best is None:
            return None
        i, n, s = best
        self._text = self._text[:i + n] if self.params.include_stop_str_in_output else self._text[:i]
        self.stop_reason = s
        return s

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to emit now: while not finished, hold back a trailing part that could still become a stop string
        (the longest stop string minus one char) so streamed text never shows a stop string; delta=True returns
        only what was not returned by a previous delta call."""
        # After a stop string the text is final: nothing can turn into a stop string any more.
        hold = 0 if finished or self.stop_reason is not None else self.stop_buffer_length
        text = self.output_text
        end = max(len(text) - hold, 0)
        if not delta:
            return text[:end]
        if end <= self._last_output_offset:
            return ""
        out = text[self._last_output_offset:end]
        self._last_output_offset = end
        return out
