"""Prompts for tests on the built-in model, which was trained on Python's standard library: code it continues
with peaked (non-tied) logits and repeats itself in, so greedy comparisons and ngram drafts mean something."""
from __future__ import annotations

from vllm.tools.prepare_corpus import heldout_code_windows

CODE_PROMPTS = ["import os\n\n\ndef ", "class Stack:\n    def __init__(self):\n", "def fibonacci(n):\n",
                "# Copyright", "    def __repr__(self):\n        return ", "from test import support\n"]


def heldout_code_ids(tokenizer, lengths: list[int]) -> list[list[int]]:
    """Token windows from standard-library files the built-in model never trained on."""
    return heldout_code_windows(tokenizer, lengths)
