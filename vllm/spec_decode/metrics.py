"""Speculative-decoding counters, per request and engine-wide (upstream's names and meanings).

A draft is one verification of one request (a row with >= 1 proposed token); draft tokens count the proposed
tokens (placeholders excluded); accepted tokens those the target kept; per position, how often draft position
i was accepted. Mean acceptance length = 1 + accepted / drafts: the tokens a verify step yields on average.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeStats:
    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # Adaptive verification's (None without it): draft tokens its budgets left unverified, which count as
    # rejected above, and steps that verified every draft to re-measure the untrimmed step (AdaptiveVerifier).
    num_unverified_draft_tokens: int | None = None
    num_remeasure_steps: int | None = None

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One verification: `num_draft_tokens` real drafts, the first `num_accepted_tokens` of them kept."""
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
