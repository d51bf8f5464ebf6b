"""What adaptive verification profiles at start-up, and how the timings become its cost curves.

MRv2's split: the package says which dummy steps to time (`batches_to_profile`) and folds what they took
(`set_initial_cost_curves`); the runner runs them. Each is timed COST_PROFILE_REPEATS times, the median kept.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from vllm.spec_decode.adaptive_verification.budget import recut_lengths
from vllm.spec_decode.adaptive_verification.costs import MIN_VERIFY_COST, CostCurve, VerifyCosts

logger = logging.getLogger(__name__)

COST_PROFILE_REPEATS = 5


@dataclass(frozen=True, slots=True)
class ProfileBatch:
    """A dummy verify step: `num_tokens` target tokens in rows of 1 + K (the last one shorter), each over
    `context` cached tokens (ModelRunner.dummy_decode_step builds it)."""
    num_tokens: int
    num_reqs: int
    context: int


@dataclass(slots=True)
class ProfileTimings:
    """What the runner measured of one ProfileBatch, in seconds, each repeated."""
    verify: list[float]  # its forward (replayed where a graph exists)
    draft: list[float]  # the draft over its requests, with confidences
    recut: list[float]  # its re-cut (RecutDummy) with the input batch's trim and the copy of its row lengths


@dataclass(slots=True)
class RecutDummy:
    """A batch re-cut to half its drafts over random confidences: what a trimmed step runs besides its graph."""
    budget: int
    num_drafts: list[int]
    confidence: torch.Tensor
    drafts: torch.Tensor
    scale: torch.Tensor

    def lengths(self) -> tuple[list[int], torch.Tensor]:
        return recut_lengths(self.budget, self.num_drafts, self.confidence, self.drafts, self.scale)


@dataclass(slots=True)
class CostProfile:
    """The start-up profile of a runner's step shapes. `captured`: the target tokens of its captured graphs,
    increasing (none: it runs eagerly)."""
    num_spec: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    captured: list[int]
    repeats: int = field(default_factory=lambda: COST_PROFILE_REPEATS)

    def batches_to_profile(self) -> Iterator[ProfileBatch]:
        """The verify step at each captured size (else powers of two up to every request's K drafts), then 1.5x
        the largest and doubling up to the token budget; each over min(1024, what fits) cached tokens."""
        per_req = 1 + self.num_spec
        top = min(self.max_num_seqs * per_req, self.max_num_batched_tokens)
        sizes = list(self.captured) or sorted({min(2 ** i, top) for i in range(top.bit_length() + 1)})
        size = int(sizes[-1] * 1.5)
        while size <= self.max_num_batched_tokens and size // per_req <= self.max_num_seqs:
            sizes.append(size)
            size *= 2
        context = max(1, min(self.max_model_len - per_req, 1024))
        for n_tokens in sizes:
            yield ProfileBatch(n_tokens, -(-n_tokens // per_req), context)

    def recut_dummy(self, batch: ProfileBatch, device: torch.device) -> RecutDummy:
        K, per_req = self.num_spec, 1 + self.num_spec
        n_reqs = batch.num_reqs
        num_drafts = [K] * (n_reqs - 1) + [batch.num_tokens - per_req * (n_reqs - 1) - 1]
        return RecutDummy(sum(num_drafts) // 2, num_drafts, torch.rand(n_reqs, K, device=device),
                          torch.tensor(num_drafts, dtype=torch.int64, device=device), torch.ones(K, device=device))

    def set_initial_cost_curves(self, samples: list[tuple[ProfileBatch, ProfileTimings]]) -> VerifyCosts:
        """The cost curves from the batches' timings: the verify step by target tokens, the draft and the
        re-cut by requests (a later batch of the same requests replaces an earlier one)."""
        verify, draft, recut = {}, {}, {}
        for batch, timings in samples:
            verify[batch.num_tokens] = timings.verify
            draft[batch.num_reqs] = timings.draft
            recut[batch.num_reqs] = timings.recut
        per_req = 1 + self.num_spec
        max_captured = self.captured[-1] if self.captured else 0
        costs = VerifyCosts(CostCurve.from_samples(draft, max_captured // per_req),
                            CostCurve.from_samples(verify, max_captured, floor=MIN_VERIFY_COST),
                            CostCurve.from_samples(recut, max_captured // per_req))
        logger.info("adaptive verification cost tables (ms): verify %s, draft %s, re-cut %s",
                    *({n: round(curve(n) * 1e3, 3) for n in table}
                      for curve, table in ((costs.verify, verify), (costs.draft, draft), (costs.recut, recut))))
        return costs
