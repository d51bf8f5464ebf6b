"""What is wrong with a prompt, in upstream's words: the engine raises it, and the server answers it with a 400
before any request of the call starts (clients match on these messages)."""
from __future__ import annotations


def prompt_problem(ids: list | None, vocab_size: int, text: str | None = None) -> str | None:
    """The problem with a prompt given as token ids and/or text, or None. An empty text is an empty prompt even
    though it encodes to [bos]; ids must be Python ints in [0, vocab_size)."""
    if text == "" or (ids is not None and len(ids) == 0):
        return "the decoder prompt cannot be empty: give at least one token"
    if ids is None:
        return None
    not_ints = [t for t in ids if not isinstance(t, int) or isinstance(t, bool)]
    if not_ints:
        return f"prompt token ids must be integers, got {not_ints[:5]}"
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        return (f"token id {bad[0]} is out of vocabulary (ids are in [0, {vocab_size})); "
                f"out-of-vocabulary ids: {bad[:5]}")
    return None
