"""Tool-call parsers by their `--tool-call-parser` name (upstream's names)."""
from __future__ import annotations

from vllm.entrypoints.openai.tool_parsers.kimi_k2_tool_parser import KimiK2ToolParser

TOOL_PARSERS = {KimiK2ToolParser.name: KimiK2ToolParser}


def get_tool_parser(name: str) -> type[KimiK2ToolParser]:
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not supported; expected one of {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]
