"""Prompts for tests on the built-in model, which was trained on Python's standard library: code it continues
with peaked (non-tied) logits and repeats itself in, so greedy comparisons and ngram drafts mean something."""
from __future__ import annotations

from vllm.tools.prepare_corpus import heldout_code_windows as heldout_code_ids  # noqa: F401 - the tests' name

CODE_PROMPTS = ["import os\n\n\ndef ", "class Stack:\n    def __init__(self):\n", "def fibonacci(n):\n",
                "# Copyright", "    def __repr__(self):\n        return ", "from test import support\n"]
