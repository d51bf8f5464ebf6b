"""What every config module checks its fields with: errors that name the flag, the value and what is allowed."""
from __future__ import annotations

import json


def require(ok: bool, flag: str, value, expected: str) -> None:
    if not ok:
        raise ValueError(f"{flag}={value!r} is invalid: expected {expected}")


def parse_json(text: str):
    """json.loads, where nesting too deep for the parser (its RecursionError) is a ValueError like any bad JSON."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("arrays or objects nested too deeply to parse") from None


def short_repr(text: str, limit: int = 80) -> str:
    """The repr of a flag's text, cut: errors stay one readable line whatever was passed."""
    r = repr(text)
    return r if len(r) <= limit else r[:limit] + f"... ({len(text)} characters)"


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
