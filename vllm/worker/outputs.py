"""What a step of the model runner returns: ModelRunnerOutput (host lists per request) and
AsyncModelRunnerOutput (the step's device outputs and the host copies queued behind them; get_output() waits for
them once)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from vllm.core.sentinels import PLACEHOLDER_TOKEN_ID
from vllm.sample.sampler import LogprobsTensors
from vllm.spec_decode.adaptive_verification import SurvivalPrediction
from vllm.utils import async_tensor_d2h
from vllm.worker.in_flight_fill import InFlightStep, InFlightTokens


@dataclass(slots=True)
class ModelRunnerOutput:
    # per sampling request: its new tokens (accepted drafts, then the recovered or bonus token; one token
    # for a row without drafts)
    sampled: dict[str, list[int]] = field(default_factory=dict)
    # per request: (token ids [k+1], logprobs [k+1], rank) of the sampled token and the top-k
    logprobs: dict[str, tuple[list[int], list[float], int]] = field(default_factory=dict)
    # per request: rows for the prompt positions this step covered (first prompt token has none)
    prompt_logprobs: dict[str, list[tuple[list[int], list[float], int]]] = field(default_factory=dict)
    # per snapshot save of the step (SchedulerOutput.saves): whether it took
    snapshots_saved: list[bool] | None = None


@dataclass(slots=True)
class HostLogprobs:
    """(token ids, logprobs, ranks) rows of a LogprobsTensors, copied to the host behind the step."""
    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor

    @classmethod
    def queue(cls, t: LogprobsTensors) -> HostLogprobs:
        return cls(async_tensor_d2h(t.token_ids), async_tensor_d2h(t.logprobs), async_tensor_d2h(t.ranks))

    def lists(self) -> tuple[list, list, list]:
        return self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()


@dataclass(slots=True)
class AsyncModelRunnerOutput:
    """A step whose work is queued on the device: its results come back through host copies queued behind it,
    which get_output() waits for. Until then the host may schedule and prepare the next step, which reads this
    one's sampled tokens on the device (`in_flight_tokens`)."""
    sampled_token_ids: torch.Tensor | None = None  # device [rows that sampled without drafts]
    sample_rows: dict[str, int] = field(default_factory=dict)  # request -> its row in sampled_token_ids
    sample_logprob_ks: list[int | None] = field(default_factory=list)  # per sample row: logprobs asked for
    sampled_host: torch.Tensor | None = None
    logprobs_host: HostLogprobs | None = None
    verify_rows: list[str] = field(default_factory=list)  # requests whose drafts were verified, in order
    verified: torch.Tensor | None = None  # device [rows, 1 + K] accepted tokens then placeholders
    verified_host: torch.Tensor | None = None
    prompt_logprobs_host: dict[str, HostLogprobs] = field(default_factory=dict)
    # The DSpark drafts proposed for the next step: they stay on the device, where the next step's inputs take
    # them (InputBatch.prepare); the host only learns how many each request got.
    draft_rows: list[str] = field(default_factory=list)  # requests the DSpark draft proposed for, in order
    drafts: torch.Tensor | None = None  # device [draft rows, K]
    # Probabilistic drafts: the distributions they were sampled from, device [draft rows, K, V] float32 (None
    # when every row drafted greedily): the next step's rejection sampler takes them as q.
    draft_probs: torch.Tensor | None = None
    done: torch.cuda.Event | None = None  # recorded behind the host copies (CUDA only)
    waited: float = 0.0  # seconds get_output() waited for the device
    num_tokens: int = 0  # target tokens the step ran, after any device trim, without graph padding
    recut: bool = False  # the device re-cut the step (adaptive verification trimmed it)
    # Adaptive verification: what the budget of this all-verify step predicted, which its accepted drafts
    # calibrate (AdaptiveVerifier.observe); None for other steps.
    survival_prediction: SurvivalPrediction | None = None
    snapshots_saved_host: torch.Tensor | None = None  # which of the step's snapshot saves took

    @property
    def in_flight_tokens(self) -> InFlightTokens | None:
        return None if self.sampled_token_ids is None else (self.sampled_token_ids, self.sample_rows)

    @property
    def in_flight_step(self) -> InFlightStep:
        return InFlightStep(self.sampled_token_ids, self.sample_rows, self.verified,
                            {rid: i for i, rid in enumerate(self.verify_rows)}, self.drafts,
                            {rid: i for i, rid in enumerate(self.draft_rows)})

    def get_output(self) -> ModelRunnerOutput:
        """Waits for the step's results (the one host-device synchronisation of a step) and returns them."""
        if self.done is not None:
            start = time.perf_counter()
            self.done.synchronize()
            self.waited = time.perf_counter() - start
        result = ModelRunnerOutput()
        if self.sampled_host is not None:
            ids = self.sampled_host.tolist()
            lp = self.logprobs_host.lists() if self.logprobs_host is not None else None
            for (rid, j), k in zip(self.sample_rows.items(), self.sample_logprob_ks):
                result.sampled[rid] = [ids[j]]
                if lp is not None and k is not None:
                    result.logprobs[rid] = (lp[0][j][:k + 1], lp[1][j][:k + 1], lp[2][j])
        if self.verified_host is not None:
            for rid, row in zip(self.verify_rows, self.verified_host.tolist()):
                # Accepted drafts are never placeholders, so the row's tokens are its non-placeholder prefix.
                result.sampled[rid] = [t for t in row if t != PLACEHOLDER_TOKEN_ID]
        if self.snapshots_saved_host is not None:
            result.snapshots_saved = self.snapshots_saved_host.tolist()
        for rid, host in self.prompt_logprobs_host.items():
            t = host.lists()
            result.prompt_logprobs[rid] = list(zip(t[0], t[1], t[2]))
        return result
