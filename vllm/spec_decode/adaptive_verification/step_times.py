"""What the engine measured of its all-verify steps: the host's part, and periods per step shape."""
from __future__ import annotations

import collections
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Measured step periods (StepTimes): the median of the last PERIOD_SAMPLES of a shape stands for its cost once it
# has MIN_PERIOD_SAMPLES; the shape that verifies every draft (the fixed-K step) is taken again when it has fewer,
# or none among the last REFRESH_STEPS periods, so that a budget is always weighed against a recent fixed-K step.
PERIOD_SAMPLES = 5
MIN_PERIOD_SAMPLES = 3
REFRESH_STEPS = 64


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
