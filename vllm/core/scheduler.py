"""Token-budget scheduler: running requests first, then waiting ones (FCFS), chunked prefill, preemption.

Each step hands out at most `max_num_batched_tokens` tokens over at most `max_num_seqs` requests. A prompt
longer than the budget is prefilled in chunks; prefill and decode rows mix freely. When a running request
cannot get cache room, the most recently admitted running request is preempted by recompute: its blocks
and state slot are freed and it goes back to the front of the queue to be prefilled again (prompt plus
the tokens it already generated), which gives the same tokens as if it had never been interrupted.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from vllm.config import SchedulerConfig
from vllm.core.kv_cache_manager import KVCacheManager
from vllm.core.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed for this request in this step
    is_prefilling: bool  # request state: a prompt (or recompute) chunk, whatever its length
    samples: bool  # the step reaches the request's last known token, so a new token is sampled


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is req:
                    break
            else:
                scheduled.append((req, n))
                budget -= n
                i += 1
        # New work only when nothing was preempted: admitting now would just evict it again.
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs \
                and not out.preempted_ids:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.allocate_slots(req, n):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_prefill_tokens = req.num_tokens
            req.first_scheduled_time = req.first_scheduled_time or time.monotonic()
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n
        out.scheduled = [ScheduledRequest(req, n, req.is_prefilling, req.num_computed_tokens + n == req.num_tokens)
                         for req, n in scheduled]
        return out

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance the scheduled requests, append their sampled tokens, and finish those that stop.

        Returns the requests that got a new token this step (finished ones included, with their status).
        """
        updated = []
        for s in out.scheduled:
            req = s.request
            if req.status.finished:  # aborted while the step ran
                continue
            req.num_computed_tokens += s.num_tokens
            if not s.samples:
                continue
            token = sampled[req.request_id]
            req.output_token_ids.append(token)
            status = req.check_stop(token)
            if status is not None:
                self.finish(req, status)
            updated.append(req)
        return updated

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Mark finished (stop, length or abort) and free everything the request holds."""
        if req.status.finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        del self.requests[req.request_id]

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self.finish(req, RequestStatus.FINISHED_ABORTED)
