"""What is wrong with a prompt, in upstream's words: the engine raises it, and the server answers it with a 400
before any request of the call starts (clients match on these messages)."""
from __future__ import annotations

import re

# JSON and Python strings may hold "\ud800", but it is no character: it cannot be tokenized nor sent back.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def text_problem(text: str | None) -> str | None:
    """The problem with a prompt's text, checked before it is tokenized, or None."""
    if isinstance(text, str) and LONE_SURROGATE.search(text):
        shown = repr(text) if len(text) <= 60 else repr(text[:60]) + f"... ({len(text)} characters)"
        return (f"the prompt {shown} holds a lone UTF-16 surrogate (such as \\ud800), which is not a character: "
                "pass valid Unicode text")
    return None


def prompt_problem(ids: list | None, vocab_size: int, text: str | None = None) -> str | None:
    """The problem with a prompt given as token ids and/or text, or None. An empty text is an empty prompt even
    though it encodes to [bos]; ids must be Python ints in [0, vocab_size)."""
    if text == "" or (ids is not None and len(ids) == 0):
        return "the decoder prompt cannot be empty: give at least one token"
    if (problem := text_problem(text)) is not None:
        return problem
    if ids is None:
        return None
    # The common case in C (min, max, one set of the types): the comprehensions below took ~10 ms per 100K ids,
    # run in the server's event loop and again in the engine core's step loop. They only name what is wrong.
    if set(map(type, ids)) <= {int} and 0 <= min(ids) and max(ids) < vocab_size:
        return None
    not_ints = [t for t in ids if not isinstance(t, int) or isinstance(t, bool)]
    if not_ints:
        return f"prompt token ids must be integers, got {not_ints[:5]}"
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        return (f"token id {bad[0]} is out of vocabulary (ids are in [0, {vocab_size})); "
                f"out-of-vocabulary ids: {bad[:5]}")
    return None
