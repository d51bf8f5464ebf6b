"""StructuredOutputsParams: the constraint one request's output must follow (upstream's names and fields).

Exactly one of `json` (a JSON schema, as a dict or its text), `json_object` (any JSON object), `regex`, `choice`
(one of these strings) or `grammar` (EBNF, xgrammar's GBNF dialect) is given. The constraint is checked when the
params are built, so a malformed schema, regex or grammar is refused before the request reaches the engine.
"""
from __future__ import annotations

import json as _json
import re
from dataclasses import dataclass
from typing import Any

_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# xgrammar's errors start with a timestamp and a C++ source location; the reason is what follows.
_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass(slots=True)
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens (shorter outputs)

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured outputs need exactly one of json, json_object, regex, choice or grammar; "
                             f"got {', '.join(given) if given else 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its text), got "
                             f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be true, got {self.json_object!r}")
        self.grammar_spec()  # raises ValueError naming what is malformed

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on (the compiler's cache key)."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json" and isinstance(value, dict):
            value = _json.dumps(value, sort_keys=True)
        elif kind == "choice":
            value = "\n".join(value)
        return kind, "" if value is True else value, self.disable_any_whitespace

    def grammar_spec(self) -> tuple[str, str]:
        """(xgrammar source kind, source): checked by parsing it without a tokenizer (a few ms at most)."""
        import xgrammar as xgr

        kind = self.kind
        try:
            if kind == "json":
                schema = self.json if isinstance(self.json, str) else _json.dumps(self.json)
                xgr.Grammar.from_json_schema(schema, any_whitespace=not self.disable_any_whitespace)
                return "json", schema
            if kind == "json_object":
                return "json_object", ""
            if kind == "regex":
                xgr.Grammar.from_regex(self.regex)
                return "regex", self.regex
            source = ("root ::= " + " | ".join(_json.dumps(c) for c in self.choice) if kind == "choice"
                      else self.grammar)
            xgr.Grammar.from_ebnf(source)
            return "ebnf", source
        except (RuntimeError, ValueError, TypeError) as e:
            reason = _NATIVE_PREFIX.sub("", str(e).strip()).strip()
            raise ValueError(f"structured_outputs.{kind} is not valid: {reason}") from None

    @classmethod
    def from_dict(cls, data: Any) -> StructuredOutputsParams:
        """From a request's `structured_outputs` object: unknown keys are named, not ignored."""
        if not isinstance(data, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(data).__name__}")
        known = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"structured_outputs has unknown keys {unknown}; expected some of {sorted(known)}")
        return cls(**{k: v for k, v in data.items() if k in known})
