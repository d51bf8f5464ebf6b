"""Shared by the speculative-decoding tests: a proposer whose drafts are right or wrong by design."""
from __future__ import annotations

import numpy as np


class ScriptedProposer:
    """Drafts the true greedy continuation (from a run without speculation) with chosen mistakes: a request's
    s-th proposal has s % (K + 1) drafts and its first wrong one at a position that varies with s and the
    request, so verify rows accept every count from 0 to K, sometimes all (then the bonus token follows)."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], K: int, vocab: int) -> None:
        self.reference, self.K, self.vocab = reference, K, vocab
        self.calls: dict[tuple[int, ...], int] = {}

    def propose(self, tokens: np.ndarray) -> list[int]:
        tokens = np.asarray(tokens).tolist()
        for r, (prompt, ref) in enumerate(self.reference.items()):
            if tuple(tokens[:len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                assert tokens[len(prompt):] == ref[:done], "the engine diverged from the reference"
                s = self.calls[prompt] = self.calls.get(prompt, 0) + 1
                drafts = list(ref[done:done + s % (self.K + 1)])
                wrong = (3 * s + r) % (len(drafts) + 1)  # == len(drafts): all right
                if wrong < len(drafts):
                    drafts[wrong] = (drafts[wrong] + 1) % self.vocab
                return drafts
        raise AssertionError("a request the script does not know")
