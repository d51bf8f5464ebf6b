"""Prompt types, as upstream's `vllm.inputs`: what `LLM.generate` and `AsyncLLM.generate` accept besides a plain
string. They are TypedDicts, so a plain dict with the same keys is the same prompt."""
from __future__ import annotations

from typing import TypedDict

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text the ids came from, reported back in RequestOutput.prompt


PromptType = str | TextPrompt | TokensPrompt | list[int]

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
