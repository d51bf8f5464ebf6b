"""N-gram (prompt lookup) proposer: drafts tokens by copying what followed an earlier occurrence of the suffix.

Matching rule (the same as upstream vLLM v1's KMP-based proposer, so drafts agree token for token):
  * n is the LONGEST length in [prompt_lookup_min, prompt_lookup_max] such that the last n tokens also occur
    ending at some earlier position (occurrences may overlap the suffix itself, e.g. `a a a a`);
  * among the occurrences of that n-gram, the EARLIEST one is used (it has the most tokens after it, so it drafts
    the fullest window; upstream makes the same choice);
  * the draft is the up-to-K tokens that follow it: fewer when the sequence ends first, and, when max_model_len is
    given, never past max_model_len - len(tokens). No occurrence (or a sequence shorter than prompt_lookup_min)
    gives [].

Cost: one vectorised comparison over the sequence for n = 1, then refinement over the surviving candidate
positions only, so O(len) numpy work plus O(prompt_lookup_max * #candidates); no Python loop over tokens.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vllm.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4,
                 max_model_len: int | None = None) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens!r} is invalid: expected >= 1")
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={prompt_lookup_min!r}, prompt_lookup_max={prompt_lookup_max!r} "
                             "are invalid: expected 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.max_model_len = max_model_len

    @classmethod
    def from_config(cls, config: SpeculativeConfig, max_model_len: int | None = None) -> NgramProposer:
        return cls(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max, max_model_len)

    def propose(self, token_ids: Sequence[int] | np.ndarray) -> list[int]:
        """Return 0..K draft tokens for one request's tokens (prompt + output so far)."""
        tokens = np.asarray(token_ids)
        if tokens.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tokens.shape}")
        length = tokens.shape[0]
        k = self.k if self.max_model_len is None else min(self.k, self.max_model_len - length)
        if length < max(self.min_n, 2) or k <= 0:
            return []
        # cand: end positions e <= length-2 (earlier than the suffix itself) where tokens[e-n+1 : e+1] equals the
        # last n tokens; kept sorted ascending, so cand[0] is the earliest occurrence.
        cand = np.flatnonzero(tokens[:-1] == tokens[-1])
        best_n, best_end = 0, -1
        n = 1
        while cand.size:
            if n >= self.min_n:
                best_n, best_end = n, int(cand[0])
            if n == self.max_n:
                break
            n += 1
            cand = cand[cand >= n - 1]  # the occurrence must start at index >= 0
            cand = cand[tokens[cand - (n - 1)] == tokens[length - n]]
        if best_n == 0:
            return []
        start = best_end + 1
        return tokens[start:start + k].tolist()

    def propose_batch(self, token_lists: Sequence[Sequence[int] | np.ndarray]) -> list[list[int]]:
        return [self.propose(t) for t in token_lists]
