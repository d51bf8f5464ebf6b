"""Request: one sequence being generated, and its status machine."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm.sampling_params import SamplingParams
from vllm.spec_decode.metrics import SpecDecodeStats

if TYPE_CHECKING:  # the scheduler's side imports no torch; the worker makes the generators
    import torch


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # a step failed because of this request alone; the others ran on

    @property
    def finished(self) -> bool:
        # Identity tests: asked several times per request per step, and Enum's .value and hash are Python-level.
        return self is not _WAITING and self is not _RUNNING and self is not _PREEMPTED


_WAITING, _RUNNING, _PREEMPTED = RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens or what max_model_len leaves
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # advanced when a step is scheduled (see Scheduler._scheduled)
    # Tokens sampled by steps in flight, not yet in output_token_ids (async scheduling: at most one).
    num_output_placeholders: int = 0
    # Tokens to prefill since the request was last (re)admitted: the prompt, or after a preemption by
    # recompute the prompt plus the outputs so far. A request is prefilling until they are all computed.
    num_prefill_tokens: int = 0
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    # Prefix caching: prompt tokens found in the cache when the request was first scheduled (RequestOutput's
    # num_cached_tokens); the chain hashes of its full blocks, extended as its tokens are known; the prompt
    # positions whose chunk ends there for a KDA snapshot; and the next decode position that takes one.
    num_cached_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    snapshot_cuts: list[int] = field(default_factory=list)
    next_snapshot: int = 0
    # Speculative decoding. `speculate`: the engine may draft for this request (its sampling needs nothing the
    # rejection sampler lacks). `spec_token_ids`: drafts proposed after the last step, verified in the next one.
    # `num_accepted_tokens`: tokens the last step kept (1 + accepted drafts); KDA layers read the state from
    # checkpoint column num_accepted_tokens - 1.
    speculate: bool = False
    spec_token_ids: list[int] = field(default_factory=list)
    num_accepted_tokens: int = 1
    # Drafts scheduled in steps whose results are not back yet (async scheduling). num_computed_tokens counts them
    # as accepted; the device takes the rejected ones back from the next row's positions (InputBatch.prepare).
    num_spec_in_flight: int = 0
    spec_stats: SpecDecodeStats | None = None
    # Fault containment: a request that was in a failed step is a suspect, run alone until it samples in a step
    # that succeeds (then the failure was someone else's); `num_failed_steps` bounds how often it may be retried.
    suspect: bool = False
    num_failed_steps: int = 0
    # Structured outputs: the request's grammar and matcher (vllm/structured_output), None when unconstrained.
    structured_output: Any = None
    # all_token_ids()'s buffer and how many of its leading entries are current.
    _token_buf: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _token_buf_len: int = field(default=0, init=False, repr=False, compare=False)

    def all_token_ids(self) -> np.ndarray:
        """Prompt + output tokens as a read-only int64 view, extended in place by the outputs appended since the
        last call: the ngram proposer reads every decoding request's tokens each step, and converting the whole
        list each time cost O(context) per request per step. Outputs only grow (the scheduler appends them)."""
        P, n = len(self.prompt_token_ids), self.num_tokens
        assert self._token_buf_len <= n, "output_token_ids shrank under all_token_ids()"
        if self._token_buf is None:
            self._token_buf = np.empty(max(2 * n, 16), dtype=np.int64)
            self._token_buf[:P] = self.prompt_token_ids
            self._token_buf_len = P
        if n > self._token_buf.shape[0]:
            grown = np.empty(2 * n, dtype=np.int64)
            grown[:self._token_buf_len] = self._token_buf[:self._token_buf_len]
            self._token_buf = grown
        self._token_buf[self._token_buf_len:n] = self.output_token_ids[self._token_buf_len - P:]
        self._token_buf_len = n
        view = self._token_buf[:n]
        view.flags.writeable = False
        return view

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_scheduled_tokens_left(self) -> int:
        """Tokens to compute before the request is up to date, counting those in flight as known and drafts in
        flight as rejected (a verify step in flight emits at least its first token)."""
        return self.num_tokens + self.num_output_placeholders - self.num_computed_tokens + self.num_spec_in_flight

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prefill_tokens

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) without building the whole list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    def check_stop(self, token: int) -> RequestStatus | None:
        """Status after appending `token`, or None to keep going (min_tokens defers every stop but length)."""
        params = self.sampling_params
        n_out = len(self.output_token_ids)
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.all_stop_token_ids:
                self.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if n_out >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
