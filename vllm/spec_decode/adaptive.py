"""Adaptive verification (shared docs: dspark_and_adaptive.md): how many draft tokens a step verifies, and whose.

The host picks the step's draft budget b* from the draft confidences and profiled step costs, and spreads it
evenly over the verifying requests (its metadata then has the right total); the device re-cuts the same total
by survival, a global top-b* over the fresh confidences, and rewrites the row offsets the kernels and the
rejection sampler read. The two splits differ row by row ([3, 3] on the host, [4, 2] on the device) and agree
in total.
"""
from __future__ import annotations

import collections
import itertools
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm.utils import async_tensor_h2d

MIN_VERIFY_COST = 1e-6  # a verify step is never free: keeps the ratio finite
# Measured step periods (StepTimes): the median of the last PERIOD_SAMPLES of a shape stands for its cost once it
# has MIN_PERIOD_SAMPLES; the shape that verifies every draft (the fixed-K step) is taken again when it has fewer,
# or none among the last REFRESH_STEPS periods, so that a budget is always weighed against a recent fixed-K step.
PERIOD_SAMPLES = 5
MIN_PERIOD_SAMPLES = 3
REFRESH_STEPS = 64
# Survival calibration (SurvivalCalibration): the per-position ratios weigh about the last CALIBRATION_ROWS
# verified rows, and CALIBRATION_PRIOR pseudo-slots at ratio 1 keep a few rows from swinging them far.
CALIBRATION_ROWS = 512
CALIBRATION_PRIOR = 2.0
# Outcomes are folded into the ratios in batches of at least this many rows: per step the engine only queues its
# outcome, where folding each one cost ~17 us of host time (a dozen small numpy calls) at 8 requests.
CALIBRATION_BATCH_ROWS = 128


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


@dataclass(slots=True)
class SurvivalPrediction:
    """What an all-verify step's budget read: each row's survivals (uncalibrated) and which rows the host had
    confidences for (the others read 1.0, a placeholder, not a prediction); then which slots the step verified.
    The step's outcome is set against it (AdaptiveVerifier.observe). Kept as read: the sums are taken when the
    outcome comes, after the step is launched, not before it."""
    survivals: np.ndarray  # [R, K] running products, the rows in step order
    known: np.ndarray | None  # [R] bool: the rows that count; None: every row (the steady state)
    drafts: np.ndarray | None  # [R] drafts scheduled per row; None: K each
    # The rows' lengths on the device (1 + drafts verified) of a step re-cut there, as a host copy queued behind
    # the step (the runner sets it: it applies the re-cut); read once the step's outputs have landed. None: the
    # step verified every scheduled draft.
    device_lens: torch.Tensor | None = None

    def verified(self) -> np.ndarray | None:
        """Drafts verified per row [R]; None: K each."""
        if self.device_lens is not None:
            return self.device_lens.numpy().astype(np.int64) - 1
        return self.drafts


@dataclass(slots=True)
class SurvivalCalibration:
    """Per draft position i, the ratio of observed to predicted survival over recently verified slots, which the
    budget's survivals are multiplied by: S'_i = min(1, r_i * S_i), then made non-increasing along the row.

    Why: the confidence head is trained for the acceptance of sampling (sum_v min(p, q)), and the host reads
    confidences one step stale (the drafts before the ones it judges). What a slot is worth is what this
    serving accepts: under greedy the built-in draft's positions are accepted at 0.73 / 0.46 / 0.33 where its
    head predicts about 0.54 / 0.26 / 0.13, and survivals that low make trimming look better than it is.

    Every all-verify step whose survivals were read counts, over the slots it verified: a row's first c drafts,
    c its scheduled drafts, or its device cap in a step re-cut there. A row that accepted a of them survived
    exactly at slots 0..a-1. Slots past c are left out even where known (a < c: they did not survive), so that
    which slots count depends on the confidences alone, never on the outcome; counting them only when a < c
    would count the rows that failed early. Rows the host had no confidences for are left out too. Sums decay
    by row (about the last CALIBRATION_ROWS rows count), so the ratios follow a changing workload;
    CALIBRATION_PRIOR slots at ratio 1 shrink the first few rows' ratios. Outcomes are queued and folded in
    batches of CALIBRATION_BATCH_ROWS rows."""
    num_spec: int
    predicted: np.ndarray = field(init=False)
    observed: np.ndarray = field(init=False)
    # r_i = observed_i / predicted_i, shrunk towards 1 by the prior; updated with them (the budget reads it every
    # step), and `version` counts the updates (the device's copy follows it).
    scale: np.ndarray = field(init=False)
    version: int = 0
    num_rows: int = 0  # rows folded in since start (for logs)
    _pending: list[tuple[SurvivalPrediction, list[int]]] = field(default_factory=list)
    _pending_rows: int = 0

    def __post_init__(self) -> None:
        self.predicted = np.zeros(self.num_spec)
        self.observed = np.zeros(self.num_spec)
        self.scale = np.ones(self.num_spec)

    def apply(self, survivals: np.ndarray) -> np.ndarray:
        """Survivals [R, K] (running products) -> calibrated: scaled, at most 1, never rising along a row."""
        scaled = survivals * self.scale
        np.minimum(scaled, 1.0, out=scaled)
        return np.minimum.accumulate(scaled, axis=1, out=scaled)

    def observe(self, prediction: SurvivalPrediction, num_accepted: list[int]) -> None:
        """A step's outcome: each row's accepted drafts, in step order. Queued; folded in once the queue holds
        CALIBRATION_BATCH_ROWS rows."""
        self._pending.append((prediction, num_accepted))
        self._pending_rows += len(num_accepted)
        if self._pending_rows >= CALIBRATION_BATCH_ROWS:
            self.fold()

    def fold(self) -> None:
        """Folds the queued outcomes into the sums and the ratios, as one batch of rows."""
        if not self._pending:
            return
        predictions = [p for p, _ in self._pending]
        survivals = np.concatenate([p.survivals for p in predictions])
        accepted = np.array(list(itertools.chain.from_iterable(row for _, row in self._pending)), dtype=np.int64)
        self._pending, self._pending_rows = [], 0
        K = self.num_spec
        verified = [p.verified() for p in predictions]
        if all(p.known is None for p in predictions) and all(v is None for v in verified):  # the steady state
            rows, predicted = len(accepted), survivals.sum(0)
        else:  # the slots that count: verified, in rows the host had confidences for
            counted = np.concatenate([p.known if p.known is not None else np.ones(len(p.survivals), bool)
                                      for p in predictions])
            caps = np.concatenate([v if v is not None else np.full(len(p.survivals), K)
                                   for p, v in zip(predictions, verified)])
            slots = (np.arange(K)[None, :] < caps[:, None]) & counted[:, None]
            accepted = accepted[counted]
            rows, predicted = len(accepted), np.where(slots, survivals, 0.0).sum(0)
        # Slot i survived in the rows that accepted more than i drafts.
        survived = np.bincount(accepted, minlength=K + 1)[::-1].cumsum()[::-1][1:K + 1]
        keep = (1.0 - 1.0 / CALIBRATION_ROWS) ** rows
        self.predicted = keep * self.predicted + predicted
        self.observed = keep * self.observed + survived
        self.scale = (self.observed + CALIBRATION_PRIOR) / (self.predicted + CALIBRATION_PRIOR)
        self.version += 1
        self.num_rows += rows


@dataclass(slots=True)
class MeasuredShape:
    """The last PERIOD_SAMPLES periods of one step shape, their median, and when the latest was recorded."""
    periods: collections.deque = field(default_factory=lambda: collections.deque(maxlen=PERIOD_SAMPLES))
    median: float = 0.0
    last_seen: int = 0  # StepTimes.num_steps at the latest
    asked: int | None = None  # StepTimes.num_steps when a step of this shape was last launched to re-measure it

    def add(self, period: float, step: int) -> None:
        self.periods.append(period)
        self.median = statistics.median(self.periods)
        self.last_seen = step


@dataclass(slots=True)
class StepTimes:
    """What the engine measured of its all-verify steps, which the budget weighs with the device's cost tables.

    - `host`: the host's own work per step, an exponential moving average: the engine loop's period from one such
      step to the next (scheduling, launching, processing and sending the outputs), less its waits for the
      device. The tables time the device alone; under async scheduling the host's part overlaps it, so once the
      host is the slower side, verifying fewer drafts shortens nothing.
    - the period itself, per step shape (requests, graph tokens): what a step of that shape really cost, host,
      device and their overlap together, as the loop's period in which it was the step waited for (under async
      scheduling that is the step before the one launched). The median of the last few replaces the tables'
      estimate for that shape: the tables, profiled on dummy steps, can misjudge a shape in either direction.
      Steps the device re-cut are kept apart, as their own shapes: they ran the re-cut besides the same graph.

    docs/spec_decode.md, "Adaptive verification", has the H200 case where the device tables alone trimmed at a
    loss. Off CUDA nothing is recorded: there the host runs the forward itself."""
    overlapped: bool = True  # async scheduling: a step costs max(host, device), else their sum
    # Target tokens (an int or an array) -> the graph sizes they run in (CostCurve.padded); None: as they are.
    padded: Callable[[Any], Any] | None = None
    smoothing: float = 0.1  # weight of the newest step in `host`: about the last 10-20 steps count
    host: float = 0.0  # seconds; 0: nothing recorded yet (the budget then weighs the device alone)
    num_steps: int = 0  # periods recorded
    _shapes: dict[int, dict[int, MeasuredShape]] = field(default_factory=dict)  # requests -> graph tokens -> it
    _recut_shapes: dict[int, dict[int, MeasuredShape]] = field(default_factory=dict)  # the same, of re-cut steps
    # Caches for the budget's per-step host work: a size's graph, and which budgets share each graph.
    _graphs: dict[int, int] = field(default_factory=dict)
    _spans: dict[tuple[int, int], dict[int, slice]] = field(default_factory=dict)

    def graph_tokens(self, num_tokens: int) -> int:
        """The graph size a step of `num_tokens` target tokens runs in: the token half of its shape."""
        graph = self._graphs.get(num_tokens)
        if graph is None:
            graph = self._graphs[num_tokens] = int(self.padded(num_tokens)) if self.padded is not None else num_tokens
        return graph

    def record(self, period: float, waited: float, drained: tuple[int, int, bool] | None) -> None:
        """One loop period (seconds) and its waits for the device; `drained`: (requests, target tokens, whether
        the device re-cut it) of the all-verify step it waited for, None when that step was not one."""
        host = period - waited
        self.host = host if self.host == 0.0 else self.host + self.smoothing * (host - self.host)
        if drained is None:
            return
        reqs, tokens, recut = drained[0], self.graph_tokens(drained[1]), drained[2]
        shapes = self._recut_shapes if recut else self._shapes
        shape = shapes.setdefault(reqs, {}).setdefault(tokens, MeasuredShape())
        self.num_steps += 1
        shape.add(period, self.num_steps)

    def stale(self, num_reqs: int, num_tokens: int) -> bool:
        """Whether this shape's period needs taking again: fewer than MIN_PERIOD_SAMPLES periods, or none in the
        last REFRESH_STEPS; and no step launched to re-measure it whose period may still be on its way (under
        async scheduling it is recorded two steps after its launch, one period later)."""
        shape = self._shapes.get(num_reqs, {}).get(self.graph_tokens(num_tokens))
        if shape is None:
            return True
        if shape.asked is not None and shape.last_seen <= shape.asked and self.num_steps - shape.asked <= 1:
            return False  # asked for, and no period of it recorded since
        return len(shape.periods) < MIN_PERIOD_SAMPLES or self.num_steps - shape.last_seen >= REFRESH_STEPS

    def remeasure(self, num_reqs: int, num_tokens: int) -> None:
        """A step of this shape is launched to re-measure it (see stale)."""
        shapes = self._shapes.setdefault(num_reqs, {})
        shape = shapes.setdefault(self.graph_tokens(num_tokens), MeasuredShape())
        shape.asked = self.num_steps

    def summary_ms(self) -> dict[str, float]:
        """'requests x graph tokens' -> the median of its last periods, in ms (for benchmarks and logs)."""
        return {f"{reqs}x{tokens}{suffix}": 1e3 * shape.median
                for table, suffix in ((self._shapes, ""), (self._recut_shapes, " re-cut"))
                for reqs, shapes in sorted(table.items()) for tokens, shape in sorted(shapes.items())
                if shape.periods}

    def step_costs(self, device: np.ndarray, num_reqs: int, num_non_draft_tokens: int) -> np.ndarray:
        """The cost at each budget b = 0..len - 1 from the device's (draft + verify tables): max(host, device)
        overlapped, else host + device; then each shape measured at these requests takes its median period."""
        cost = np.maximum(device, self.host) if self.overlapped else device + self.host
        measured = self._shapes.get(num_reqs)
        if measured:
            spans = self._budget_spans(num_non_draft_tokens, len(cost))
            for tokens, shape in measured.items():
                span = spans.get(tokens)
                if span is not None and shape.periods:  # (a shape asked to re-measure may have none yet)
                    cost[span] = shape.median
        return cost

    def take_recut_periods(self, cost: np.ndarray, num_reqs: int, num_non_draft_tokens: int,
                           num_drafts: int) -> None:
        """In place: the budgets below `num_drafts` (those that re-cut the step) whose graph a re-cut step of
        these requests was measured in take that step's median period."""
        measured = self._recut_shapes.get(num_reqs)
        if not measured:
            return
        spans = self._budget_spans(num_non_draft_tokens, len(cost))
        for tokens, shape in measured.items():
            span = spans.get(tokens)
            if span is not None:
                cost[span.start:min(span.stop, num_drafts)] = shape.median

    def _budget_spans(self, num_non_draft_tokens: int, num_budgets: int) -> dict[int, slice]:
        """Graph tokens -> the budgets 0..num_budgets - 1 whose steps run in that graph (a run: graphs grow with
        the budget)."""
        key = (num_non_draft_tokens, num_budgets)
        spans = self._spans.get(key)
        if spans is None:
            tokens = num_non_draft_tokens + np.arange(num_budgets)
            graphs = self.padded(tokens) if self.padded is not None else tokens
            sizes, starts = np.unique(graphs, return_index=True)
            ends = np.append(starts[1:], num_budgets)
            spans = self._spans[key] = {int(g): slice(int(a), int(b)) for g, a, b in zip(sizes, starts, ends)}
        return spans


class AdaptiveVerifier:
    """The device-trim hook (ModelRunner.set_device_trim_hook) of adaptive verification with DSpark.

    On an all-verify step: survivals from the newest landed host copy of the draft's confidences (one step
    stale under async scheduling), calibrated by what earlier steps accepted (SurvivalCalibration), b* from
    the cost tables and what the engine measured (StepTimes; a trim only against a recent measurement of the
    untrimmed step), the host's even split for the metadata, and the device's survival split from the device
    table. A step whose survivals were read leaves its prediction (take_prediction), and the engine hands back
    what the step accepted (observe)."""

    def __init__(self, confidences: DraftConfidences, costs: VerifyCosts, max_total_logits: int,
                 times: StepTimes | None = None) -> None:
        self.confidences, self.costs, self.max_total_logits = confidences, costs, max_total_logits
        self.times = times  # the engine records into it (on CUDA); None: the device tables alone, as upstream
        self.last_budget: int | None = None  # for tests and logs
        self.num_offered = self.num_kept = 0  # drafts scheduled in all-verify steps, and those the budgets kept
        self.num_refreshed = 0  # steps that verified every draft to re-measure that shape (StepTimes.stale)
        self._full: torch.Tensor | None = None  # K drafts per row, for steps where every row has all K
        self.calibration = SurvivalCalibration(confidences.num_spec)
        self._prediction: SurvivalPrediction | None = None  # the last call's, until taken
        self._scale: tuple[int, torch.Tensor] | None = None  # (calibration version, its scale on the device)
        self._can_trim: dict[tuple[int, int], bool] = {}  # (requests, drafts) -> can_trim

    def _full_rows(self, num_rows: int, device: torch.device) -> torch.Tensor:
        if self._full is None or self._full.shape[0] < num_rows:
            self._full = torch.full((max(num_rows, 64),), self.confidences.num_spec, dtype=torch.int64, device=device)
        return self._full[:num_rows]

    def can_trim(self, num_reqs: int, num_drafts: int) -> bool:
        """Whether a budget below `num_drafts` can run an all-verify step of `num_reqs` rows in a smaller graph
        than verifying every draft. Not at one request with K = 3: every budget's 1-4 tokens pad to the 4-token
        graph (capture sizes are multiples of 1 + K). There the budget keeps every draft without reading the
        confidences, and the runner skips their host copy: at one request on the H100 the hook took 27 us and the
        copy 78 us of host time per step (bench_adaptive_hook.py), for nothing."""
        key = (num_reqs, num_drafts)
        can = self._can_trim.get(key)
        if can is None:
            padded = self.costs.verify.padded
            can = self._can_trim[key] = bool(padded(num_reqs) < padded(num_reqs + num_drafts))
        return can

    def take_prediction(self) -> SurvivalPrediction | None:
        """The prediction of the step the last call planned, if it read survivals; once."""
        prediction, self._prediction = self._prediction, None
        return prediction

    def observe(self, prediction: SurvivalPrediction, num_accepted: list[int]) -> None:
        """What the step of `prediction` accepted, per row in its order (once its outputs have landed)."""
        self.calibration.observe(prediction, num_accepted)

    def _device_scale(self, device: torch.device) -> torch.Tensor:
        """The calibration's scale on the device, uploaded again only once it changed (a fold of queued
        outcomes, every CALIBRATION_BATCH_ROWS rows)."""
        cal = self.calibration
        if self._scale is None or self._scale[0] != cal.version:
            self._scale = (cal.version, async_tensor_h2d(cal.scale, torch.float32, device))
        return self._scale[1]

    def __call__(self, out, common) -> tuple[list[int], torch.Tensor] | None:
        self._prediction = None
        rows = out.scheduled
        R, K = len(rows), self.confidences.num_spec
        # (Python lists here and below: at a few requests each numpy call costs more than the work it does.)
        drafts = [len(s.draft_token_ids) for s in rows]
        offered = sum(drafts)
        full = offered == R * K  # every row has all K drafts (none has more)
        most = min(offered, self.max_total_logits - R)  # the largest budget: every draft, within one chunk
        times = self.times
        if most == offered and (not self.can_trim(R, offered) or times is not None and times.overlapped
                                and times.host >= self.costs.step_costs(R, R, offered)[-1]):
            # No budget shortens the step: each runs in the untrimmed step's graph (a trim would only add its
            # re-cut), or the host is the slower side even with every draft verified. choose_budget would keep
            # every draft (short of drafts whose survival is 0): skip reading confidences.
            budget = offered
        else:
            request_ids = [s.request.request_id for s in rows]
            host_conf, known = self.confidences.host_rows(request_ids)
            # Every scheduled slot's survival: the running product of its row's confidences, up to its drafts.
            raw = host_conf.cumprod(axis=1)
            survivals = self.calibration.apply(raw)
            drafts_per_row = None if full else np.array(drafts)
            survivals = survivals.ravel() if full else survivals[np.arange(K)[None, :] < drafts_per_row[:, None]]
            budget = choose_budget(survivals, R, R, R, self.max_total_logits, 1, self.costs, times)
            if budget < most and times is not None and times.stale(R, R + most):
                # A trimmed step is only chosen against a recent measurement of the untrimmed one, which is what
                # fixed K runs: at worst one step in REFRESH_STEPS verifies drafts the budget would have cut.
                budget = most
                self.num_refreshed += 1
                times.remeasure(R, R + most)
            # Its outcome calibrates the survivals (observe); a re-cut's caps are added by the runner.
            self._prediction = SurvivalPrediction(raw, known, drafts_per_row)
        self.last_budget = budget
        self.num_offered += offered
        self.num_kept += budget
        if budget == offered:
            return None  # every draft is worth verifying: the step runs as scheduled, with no re-cut to queue
        device_conf = self.confidences.device_rows(request_ids)
        device_drafts = self._full_rows(R, device_conf.device) if full \
            else async_tensor_h2d(drafts, torch.int64, device_conf.device)
        return recut_lengths(budget, drafts, device_conf, device_drafts, self._device_scale(device_conf.device))


class DraftConfidences:
    """The latest confidences of each request's drafts, as adaptive verification reads them: on the device, the
    table the drafter wrote last [rows, K] (the device split takes it, as fresh as the drafts it judges); on the
    host, the newest table whose copy has landed (the budget takes it). The host copy is queued behind the
    drafter and never waited for: under async scheduling the next step is planned while it is still on its way,
    so the host plans with the table one step older, as upstream does. Requests without confidences read 1.0
    (as upstream starts them).

    On CUDA the copy runs on a stream of its own: on the step's stream a copy to the host, however small, holds
    the next kernel for its round trip (6.4 us of the H200's ~1.56 ms step at one request), which fixed K does
    not pay. The table it reads is the draft graph's output, which the next replay rewrites: the runner has the
    step's stream wait for the copy first (before_redraft)."""

    def __init__(self, num_spec: int, device: torch.device) -> None:
        self.num_spec, self.table_device = num_spec, device
        self.index: dict[str, int] = {}  # the device table's rows
        self.device: torch.Tensor | None = None
        # Host copies not known to have landed yet, oldest first: (rows, copy, event recorded behind it).
        self._pending: list[tuple[dict[str, int], torch.Tensor, torch.cuda.Event | None]] = []
        # Two pinned buffers and their events, used in turn (CUDA only): at most two copies are pending, and a
        # copy's buffer is taken again only after it landed (and was copied out) or was superseded.
        self._buffers: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event] = []
        self._turn = 0
        self._copy_stream: torch.cuda.Stream | None = None
        self._drafted: torch.cuda.Event | None = None  # recorded behind each draft, for the copy stream to wait
        self._last_copy: torch.cuda.Event | None = None  # behind the newest copy, on the copy stream
        self.host_index: dict[str, int] = {}
        self.host: np.ndarray | None = None

    def update(self, request_ids: list[str], device: torch.Tensor, to_host: bool = True) -> None:
        """The drafter's newest table; `to_host`: also queue its host copy (False: no budget will read it, see
        AdaptiveVerifier.can_trim; the host keeps the older table, a request missing there reads 1.0)."""
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self.device = device
        if not to_host:
            return
        self._landed()
        del self._pending[:-1]  # at most two in flight: an older copy is superseded by a newer one
        if not device.is_cuda:
            self._pending.append((self.index, device.clone(), None))
            return
        if not self._buffers or self._buffers[0].shape[0] < device.shape[0]:
            # Grown buffers: a pending copy keeps its old buffer alive through its own reference.
            rows = max(device.shape[0], 64)
            self._buffers = [torch.empty(rows, self.num_spec, dtype=device.dtype, pin_memory=True) for _ in range(2)]
            self._events = [torch.cuda.Event(), torch.cuda.Event()]
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device.device)
            self._drafted = torch.cuda.Event()
        self._turn ^= 1
        host = self._buffers[self._turn][:device.shape[0]]
        event = self._events[self._turn]
        # Behind the drafter (an event of our own, recorded again each time: wait_stream would create one).
        self._drafted.record(torch.cuda.current_stream(device.device))
        self._copy_stream.wait_event(self._drafted)
        with torch.cuda.stream(self._copy_stream):
            host.copy_(device, non_blocking=True)
            event.record()
        device.record_stream(self._copy_stream)  # an eager step's table: not reused before the copy read it
        self._last_copy = event
        self._pending.append((self.index, host, event))

    def before_redraft(self) -> None:
        """Before the drafter runs again: the step's stream waits for the newest copy out of the table, which a
        draft graph's replay rewrites (a wait on the device, long done by then: the copy takes microseconds)."""
        if self._last_copy is not None:
            torch.cuda.current_stream(self.table_device).wait_event(self._last_copy)
            self._last_copy = None  # later drafts are behind this wait already

    def _landed(self) -> None:
        """Takes the newest host copy whose event has completed (a query, never a wait)."""
        while self._pending and (self._pending[0][2] is None or self._pending[0][2].query()):
            index, host, _ = self._pending.pop(0)
            # A copy out of the pinned buffer, which a later update writes again.
            self.host_index, self.host = index, host.float().numpy().copy()

    def host_rows(self, request_ids: list[str]) -> tuple[np.ndarray, np.ndarray | None]:
        """The rows of these requests [R, K] from the newest landed table, and which of them it had (a bool per
        row; None: all of them). A request it lacks reads 1.0."""
        self._landed()
        if self.host is None:
            return np.ones((len(request_ids), self.num_spec), dtype=np.float32), np.zeros(len(request_ids), bool)
        if _same_order(request_ids, self.host_index):
            return self.host, None
        picks = np.array([self.host_index.get(rid, -1) for rid in request_ids], dtype=np.int64)
        ones = np.ones((1, self.num_spec), dtype=np.float32)
        return np.concatenate([self.host, ones])[picks], picks >= 0

    def device_rows(self, request_ids: list[str]) -> torch.Tensor:
        """The rows of these requests [R, K] float32 from the latest table (the one the drafts of the step being
        planned came with). Only a step that is re-cut reads it: each eager op here runs before the step's
        graph, unoverlapped."""
        K = self.num_spec
        if self.device is None:
            return async_tensor_h2d(np.ones((len(request_ids), K), dtype=np.float32), torch.float32,
                                    self.table_device)
        if _same_order(request_ids, self.index):
            return self.device.float()  # the steady state: the requests in the order they were drafted, no gather
        # Row -1: a request with no confidences yet; it reads the 1.0 row appended here.
        picks = [self.index.get(rid, -1) for rid in request_ids]
        table = torch.cat([self.device.float(), self.device.new_ones(1, K, dtype=torch.float32)])
        idx = async_tensor_h2d(picks, torch.int64, table.device)  # pinned: a pageable copy would wait for the GPU
        return table[idx]


def _same_order(request_ids: list[str], index: dict[str, int]) -> bool:
    """Whether `index` numbers exactly these requests in this order (dicts keep insertion order)."""
    return len(request_ids) == len(index) and all(map(str.__eq__, request_ids, index))
