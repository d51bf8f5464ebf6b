"""Profiled step costs: a cost curve per size, and the verify step's costs at each budget."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MIN_VERIFY_COST = 1e-6  # a verify step is never free: keeps the ratio finite


@dataclass(slots=True)
class CostCurve:
    """Profiled step cost against a size (requests for the draft, tokens for the verify step).

    Made monotone (running max). Up to the largest captured size a step is padded to the next captured size, so
    the cost is a step function there; above it, linear interpolation between profiled tail sizes, and linear
    extrapolation past the last point (from the last two points)."""
    sizes: np.ndarray  # increasing
    costs: np.ndarray
    max_captured: int
    floor: float = 0.0
    # The curve at every size 0..len - 1, filled on first use: the budget reads it at hundreds of sizes a step
    # (every b up to the step's drafts), where a Python call per size cost milliseconds at 64 requests.
    _dense: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @classmethod
    def from_samples(cls, samples: dict[int, list[float]], max_captured: int, floor: float = 0.0) -> CostCurve:
        """samples: size -> repeated timings; the median of each is kept."""
        if not samples:
            raise ValueError("a cost curve needs at least one profiled size")
        sizes = np.array(sorted(samples), dtype=np.int64)
        costs = np.maximum.accumulate(np.array([np.median(samples[s]) for s in sizes], dtype=np.float64))
        return cls(sizes, np.maximum(costs, floor), max_captured, floor)

    def __call__(self, size: int) -> float:
        s, c = self.sizes, self.costs
        i = int(np.searchsorted(s, size, side="left"))  # the first profiled size >= size
        if i < len(s) and (size <= self.max_captured or s[i] == size or i == 0):
            return float(c[i])  # padded up to that graph (or below the first point: its cost)
        if i < len(s):
            return float(max(np.interp(size, s, c), self.floor))
        if len(s) == 1:
            return float(c[-1])
        slope = (c[-1] - c[-2]) / (s[-1] - s[-2])
        return float(max(c[-1] + slope * (size - s[-1]), self.floor))

    def padded(self, sizes):
        """The graph size steps of these many tokens (an int or an array) run in: the first profiled size at or
        above, up to the largest captured one; above it they run as they are."""
        i = np.minimum(np.searchsorted(self.sizes, sizes, side="left"), len(self.sizes) - 1)
        return np.where(np.asarray(sizes) <= self.max_captured, self.sizes[i], sizes)

    def at(self, sizes: np.ndarray) -> np.ndarray:
        """The curve at many integer sizes >= 0 (from a table of every size up to the largest asked for)."""
        top = int(sizes.max(initial=0))
        if top >= len(self._dense):
            self._dense = np.array([self(n) for n in range(max(2 * top, 64) + 1)])
        return self._dense[sizes]


@dataclass(slots=True)
class VerifyCosts:
    draft: CostCurve  # by number of requests drafted for
    verify: CostCurve  # by target tokens in the step
    # A trimmed step's own work besides its graph, by requests: the device split, the re-cut of the step's inputs
    # and the copy of its row lengths, a few dozen small ops that a step verifying every draft does not run.
    # None: free (upstream re-cuts every step, so it has no such term).
    recut: CostCurve | None = None
    # (requests, non-draft tokens, largest budget) -> the step's cost at each budget 0..largest: a step at a
    # steady concurrency asks for the same vector every time, and building it is most of the budget's host work.
    _steps: dict[tuple[int, int, int], np.ndarray] = field(default_factory=dict)
    _recuts: dict[int, float] = field(default_factory=dict)  # requests -> recut(requests), read every step

    def step_costs(self, num_reqs: int, num_non_draft_tokens: int, max_budget: int) -> np.ndarray:
        """draft[num_reqs] + verify[T0 + b] for b in 0..max_budget (never below MIN_VERIFY_COST)."""
        key = (num_reqs, num_non_draft_tokens, max_budget)
        cost = self._steps.get(key)
        if cost is None:
            verify = self.verify.at(num_non_draft_tokens + np.arange(max_budget + 1))
            cost = self._steps[key] = self.draft(num_reqs) + np.maximum(verify, MIN_VERIFY_COST)
        return cost

    def recut_cost(self, num_reqs: int) -> float:
        if self.recut is None:
            return 0.0
        cost = self._recuts.get(num_reqs)
        if cost is None:
            cost = self._recuts[num_reqs] = self.recut(num_reqs)
        return cost
