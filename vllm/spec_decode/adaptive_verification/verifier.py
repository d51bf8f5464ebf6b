"""AdaptiveVerifier: the device-trim hook that plans each all-verify step's budget and re-cut."""
from __future__ import annotations

import numpy as np
import torch

from vllm.distributed.communication_op import broadcast_object
from vllm.spec_decode.adaptive_verification.budget import choose_budget, recut_lengths
from vllm.spec_decode.adaptive_verification.calibration import SurvivalCalibration, SurvivalPrediction
from vllm.spec_decode.adaptive_verification.confidences import DraftConfidences
from vllm.spec_decode.adaptive_verification.costs import VerifyCosts
from vllm.spec_decode.adaptive_verification.step_times import StepTimes
from vllm.utils import async_tensor_h2d


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
        # Under tensor parallelism every rank runs this hook, but the budget reads this rank's measured step
        # times: rank 0's is the step's, so that every rank cuts the rows alike (a no-op on one rank).
        budget = broadcast_object(budget)
        self.last_budget = budget
        self.num_offered += offered
        self.num_kept += budget
        if budget == offered:
            return None  # every draft is worth verifying: the step runs as scheduled, with no re-cut to queue
        device_conf = self.confidences.device_rows(request_ids)
        device_drafts = self._full_rows(R, device_conf.device) if full \
            else async_tensor_h2d(drafts, torch.int64, device_conf.device)
        return recut_lengths(budget, drafts, device_conf, device_drafts, self._device_scale(device_conf.device))
