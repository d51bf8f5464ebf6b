"""Prompts for tests on the built-in model, which was trained on Python's standard library: code it continues
with peaked (non-tied) logits and repeats itself in, so greedy comparisons and ngram drafts mean something."""
from __future__ import annotations

from vllm.tools.prepare_corpus import split_of, stdlib_root

CODE_PROMPTS = ["import os\n\n\ndef ", "class Stack:\n    def __init__(self):\n", "def fibonacci(n):\n",
                "# Copyright", "    def __repr__(self):\n        return ", "from test import support\n"]
HELDOUT_PERCENT = 3.0  # the split the built-in model was trained with (benchmarks/results/default_model/)


def heldout_code_ids(tokenizer, lengths: list[int]) -> list[list[int]]:
    """Token windows of the given lengths from standard-library files the model never trained on (the split
    is by path hash, so the same files are held out on every Python), one file after another."""
    out = []
    for path in sorted(stdlib_root().rglob("*.py")):
        rel = path.relative_to(stdlib_root()).as_posix()
        if "test" in rel or split_of(rel, HELDOUT_PERCENT) != "heldout":
            continue
        ids = tokenizer(path.read_text(errors="replace"))["input_ids"]
        while len(out) < len(lengths) and len(ids) >= lengths[len(out)]:
            n = lengths[len(out)]
            out.append(ids[:n])
            ids = ids[n:]
        if len(out) == len(lengths):
            return out
    raise AssertionError("not enough held-out standard-library code for these lengths")
