"""Reasoning parsers by their `--reasoning-parser` name (upstream's names)."""
from __future__ import annotations

from vllm.reasoning.kimi_k2_reasoning_parser import KimiK2ReasoningParser

REASONING_PARSERS = {KimiK2ReasoningParser.name: KimiK2ReasoningParser}


def get_reasoning_parser(name: str) -> type[KimiK2ReasoningParser]:
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not supported; expected one of {sorted(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]
