"""Survival calibration: what verified steps accepted, against what their budgets predicted."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

# Survival calibration (SurvivalCalibration): the per-position ratios weigh about the last CALIBRATION_ROWS
# verified rows, and CALIBRATION_PRIOR pseudo-slots at ratio 1 keep a few rows from swinging them far.
CALIBRATION_ROWS = 512
CALIBRATION_PRIOR = 2.0
# Outcomes are folded into the ratios in batches of at least this many rows: per step the engine only queues its
# outcome, where folding each one cost ~17 us of host time (a dozen small numpy calls) at 8 requests.
CALIBRATION_BATCH_ROWS = 128


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
