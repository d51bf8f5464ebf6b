"""The step's draft budget b* and its two splits: the host's even one (its metadata) and the device's by
survival (what runs). Same total, different rows: [3, 3] on the host, [4, 2] on the device."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm.spec_decode.adaptive_verification.costs import VerifyCosts

if TYPE_CHECKING:
    from vllm.spec_decode.adaptive_verification.step_times import StepTimes


def choose_budget(survivals: np.ndarray, num_non_draft_tokens: int, num_sampling_reqs: int, num_reqs: int,
                  max_total_logits: int, num_bonus: int, costs: VerifyCosts, times: StepTimes | None = None) -> int:
    """b* = argmax over b in 0..B_max of (N_s + sum_{i<b} S_i) / step_cost(b). The device's part of a step is
    device(b) = draft_cost[num_reqs] + verify_cost[T0 + b], upstream's whole cost; with `times`, the host's part
    is added (overlapped or not) and measured shapes take their measured periods (StepTimes.step_costs).

    A budget below the scheduled drafts re-cuts the step on the device, which costs `costs.recut` on top (or a
    re-cut step's measured period): without it, trimming a few doubtful drafts whose step pads to the same or
    a barely cheaper graph looks free, and on the H200 such trims cost more than they saved.

    survivals: every scheduled draft slot's survival (the running product of its request's confidences), any
    order; T0 = num_non_draft_tokens; N_s = num_sampling_reqs; B_max = min(slots, max_total_logits - num_reqs *
    num_bonus), so the step's logits fit one rejection-sampler chunk. Ties go to the smaller budget."""
    S = np.sort(survivals)[::-1]
    b_max = max(0, min(len(S), max_total_logits - num_reqs * num_bonus))
    gain = np.empty(b_max + 1)
    gain[0] = num_sampling_reqs
    S[:b_max].cumsum(out=gain[1:])
    gain[1:] += num_sampling_reqs
    cost = costs.step_costs(num_reqs, num_non_draft_tokens, b_max)
    cost = cost.copy() if times is None else times.step_costs(cost, num_reqs, num_non_draft_tokens)
    cost[:len(S)] += costs.recut_cost(num_reqs)  # every budget short of the scheduled drafts re-cuts
    if times is not None:
        times.take_recut_periods(cost, num_reqs, num_non_draft_tokens, len(S))
    gain /= cost
    return int(gain.argmax())


def even_split(budget: int, num_drafts: list[int]) -> list[int]:
    """The host's split: `budget` draft slots spread evenly over the verifying rows (the remainder to the
    first ones), never more than a row's own drafts. Same total as the device's split."""
    drafts = np.asarray(num_drafts, dtype=np.int64)
    if budget > drafts.sum():
        raise ValueError(f"a budget of {budget} exceeds the {int(drafts.sum())} scheduled drafts")
    caps = np.zeros_like(drafts)
    left = budget
    while left:  # each pass fills at least one row or spends the whole budget: at most K + 1 passes
        open_rows = np.flatnonzero(caps < drafts)
        share, extra = divmod(left, len(open_rows))
        take = np.minimum(drafts[open_rows] - caps[open_rows], share + (np.arange(len(open_rows)) < extra))
        caps[open_rows] += take
        left -= int(take.sum())
    return caps.tolist()


def device_split(confidence: torch.Tensor, num_drafts: torch.Tensor, budget: int,
                 scale: torch.Tensor | None = None) -> torch.Tensor:
    """The device's split [R] (int32): the global top-`budget` slots by survival, from confidences [R, K] and
    drafts per row [R]; slots past a row's drafts never win. Survival never rises along a draft, so each row
    keeps a prefix. `scale` [K]: the calibration's per-position ratios (SurvivalCalibration), applied as on the
    host but for the cap at 1, which changes no ranking that matters: it only ties slots the budget counts as
    sure alike. No host sync: `budget` is the host's number."""
    R, K = confidence.shape
    survival = confidence.float().clamp(0, 1).cumprod(dim=1)
    if scale is not None:  # scaled, survivals may rise along a row: a running min keeps each row's kept slots a prefix
        survival = (survival * scale).cummin(dim=1).values
    past = torch.arange(K, device=confidence.device)[None, :] >= num_drafts[:, None]
    survival = survival.masked_fill(past, float("-inf"))
    # Ties broken towards earlier slots of a row, so a row's kept slots stay a prefix.
    order = survival.flatten().argsort(descending=True, stable=True)[:budget]
    keep = torch.zeros(R * K, dtype=torch.int32, device=confidence.device)
    keep.index_fill_(0, order, 1)  # not `keep[order] = 1`, whose scalar copy from pageable memory waits for the GPU
    return keep.view(R, K).sum(1, dtype=torch.int32)


def recut_lengths(budget: int, num_drafts: list[int], confidence: torch.Tensor, device_drafts: torch.Tensor,
                  scale: torch.Tensor | None) -> tuple[list[int], torch.Tensor]:
    """A re-cut step's rows, 1 + the drafts each verifies: the host's even split (its metadata) and the device's
    survival split (what runs). The hook's, and what the runner times for the re-cut's cost."""
    return [1 + c for c in even_split(budget, num_drafts)], 1 + device_split(confidence, device_drafts, budget, scale)
