"""Token-budget scheduler: running requests first, then waiting ones (FCFS), chunked prefill, preemption.

Each step hands out at most `max_num_batched_tokens` tokens over at most `max_num_seqs` requests. A prompt
longer than the budget is prefilled in chunks; prefill and decode rows mix freely. When a running request
cannot get cache room, the most recently admitted running request is preempted by recompute: its blocks
and state slot are freed and it goes back to the front of the queue to be prefilled again (prompt plus
the tokens it already generated), which gives the same tokens as if it had never been interrupted.

Speculative decoding: a decoding request with drafts runs 1 + drafts tokens (drafts trimmed to the budget),
with cache room reserved for all of them. A request with prior state whose prompt has exactly one token left
runs that token padded with placeholder drafts (-1) as a verify row, not a prefill (the padded prompt tail:
the placeholders are always rejected, and a prefill kernel would fold them into the only saved state). A
row's kind follows the request's state, never its token count: a prompt chunk of exactly 1 + K tokens is
still a prefill.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from vllm.config import SchedulerConfig
from vllm.core.kv_cache_manager import KVCacheManager
from vllm.core.request import Request, RequestStatus
from vllm.core.sentinels import PLACEHOLDER_TOKEN_ID
from vllm.core.snapshot_plan import SnapshotPlan, SnapshotSave
from vllm.spec_decode.metrics import SpecDecodeStats


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed for this request in this step, drafts included
    num_computed_tokens: int  # the request's computed tokens before this step: where its row starts
    is_prefilling: bool  # request state: a prompt (or recompute) chunk, whatever its length
    samples: bool  # the step reaches the request's last known token, so a new token is sampled
    draft_token_ids: list[int] = field(default_factory=list)  # verified this step; -1 = placeholder
    # Drafts of the request's step in flight when this row was scheduled (async scheduling): num_computed_tokens
    # counted them as accepted, and the device moves the row back by the rejected ones.
    num_spec_in_flight: int = 0

    @property
    def num_draft_tokens(self) -> int:
        """The row's tag: its draft count if it verifies (0 allowed), -1 for a prefill row."""
        return -1 if self.is_prefilling else len(self.draft_token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # Prefix caching: (snapshot slot, request's state slot) copies before the forward, for requests admitted
    # with a cached prefix; and the snapshots to take after it.
    restores: list[tuple[int, int]] = field(default_factory=list)
    saves: list[SnapshotSave] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 num_speculative_tokens: int = 0, snapshot_interval: int = 256) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.snapshots = SnapshotPlan(kv_cache_manager, snapshot_interval)
        self.num_spec = num_speculative_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.spec_stats = SpecDecodeStats(num_speculative_tokens) if num_speculative_tokens else None
        self.num_preemptions_total = 0
        # Prefix caching, in tokens since start: prompt tokens looked up, and those found (upstream's
        # vllm:prefix_cache_queries / _hits). A preempted request's lookup on readmission counts again.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def suspect(self) -> Request | None:
        """The first request in a failed step that has not sampled since (see LLMEngine._contain)."""
        return next((r for r in (*self.running, *self.waiting) if r.suspect), None)

    def schedule(self) -> SchedulerOutput:
        suspect = self.suspect
        if suspect is not None:
            return self._schedule_alone(suspect)
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int, list[int]]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if self._finishes_in_flight(req):
                i += 1
                continue
            n = self.snapshots.cut(req, min(req.num_scheduled_tokens_left, budget))
            drafts = self._drafts(req, n, budget) if self.num_spec else []
            if req.num_spec_in_flight and req.num_computed_tokens + n + len(drafts) > self.config.max_model_len:
                # Placed after every draft in flight, the row would pass --max-model-len (where the true one
                # may not): it waits for the step in flight's results, which place it exactly.
                i += 1
                continue
            while not self.kv.allocate_slots(req, n + len(drafts)):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is req:
                    break
            else:
                scheduled.append((req, n, drafts))
                budget -= n + len(drafts)
                i += 1
        # New work only when nothing was preempted: admitting now would just evict it again.
        compiling = []  # structured-output requests whose grammar is still compiling wait, keeping their places
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs \
                and not out.preempted_ids:
            req = self.waiting[0]
            if req.structured_output is not None and not req.structured_output.ready:
                compiling.append(self.waiting.popleft())
                continue
            if req.num_output_placeholders:  # preempted with a token still in flight: its prefill needs it
                break
            hit = self.kv.lookup(req) if self.kv.prefix_caching else None
            start = hit.num_tokens if hit is not None else 0
            self.snapshots.admit(req, hit)
            n = self.snapshots.cut(req, min(req.num_tokens - start, budget), start)
            if not self.kv.allocate_slots(req, n, hit):
                break
            self.waiting.popleft()
            if start:
                req.num_computed_tokens = start
                if hit.snapshot is not None:
                    out.restores.append((hit.snapshot, self.kv.state_slots(req.request_id)[0]))
            if hit is not None:
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += start
            if req.first_scheduled_time is None:
                req.num_cached_tokens = start
            req.status = RequestStatus.RUNNING
            req.num_prefill_tokens = req.num_tokens
            req.first_scheduled_time = req.first_scheduled_time or time.monotonic()
            self.running.append(req)
            scheduled.append((req, n, []))
            budget -= n
        self.waiting.extendleft(reversed(compiling))
        out.scheduled = [self._scheduled(req, n, drafts) for req, n, drafts in scheduled]
        if self.snapshots.enabled:
            self.snapshots.plan_saves(out)
        return out

    @staticmethod
    def _scheduled(req: Request, n: int, drafts: list[int]) -> ScheduledRequest:
        """The step's row for `req` (n known tokens plus drafts), and the request advanced past it at once, as
        if the step had run: with async scheduling the next step is scheduled before this one's tokens are
        back. A row that samples leaves an output placeholder until its token arrives (update_from_output);
        rejected drafts are taken back there."""
        samples = req.num_computed_tokens - req.num_spec_in_flight + n == req.num_tokens + req.num_output_placeholders
        row = ScheduledRequest(req, n + len(drafts), req.num_computed_tokens, req.is_prefilling and not drafts,
                               samples, drafts, req.num_spec_in_flight)
        req.num_computed_tokens += n + len(drafts)
        req.num_spec_in_flight += len(drafts)
        req.num_output_placeholders += samples
        return row

    @staticmethod
    def _finishes_in_flight(req: Request) -> bool:
        """The tokens in flight reach max_tokens: the request ends when they arrive, so it gets no more steps."""
        return req.num_output_placeholders > 0 and len(req.output_token_ids) + req.num_output_placeholders \
            >= req.max_tokens

    def _schedule_alone(self, req: Request) -> SchedulerOutput:
        """A step with one suspect request (one that was in a failed step) and nothing else, so that if the step
        fails again the request that makes it fail is known. Other requests wait; they keep their cache."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        drafts = self._drafts(req, n, budget) if req.status is RequestStatus.RUNNING else []
        while not self.kv.allocate_slots(req, n + len(drafts)):
            victims = [r for r in self.running if r is not req]
            if not victims:
                return out  # the request alone does not fit the cache: nothing can run it
            self.running.remove(victims[-1])
            self._preempt(victims[-1])
            out.preempted_ids.append(victims[-1].request_id)
        if req in self.waiting:
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            req.num_prefill_tokens = req.num_tokens
            req.first_scheduled_time = req.first_scheduled_time or time.monotonic()
            self.running.insert(0, req)
        out.scheduled = [self._scheduled(req, n, drafts)]
        return out

    def _drafts(self, req: Request, n: int, budget: int) -> list[int]:
        """The drafts a running request verifies this step, given n known tokens scheduled and the budget."""
        room = min(budget - n, self.num_spec)  # never more drafts than the request has checkpoint columns
        if not req.is_prefilling:
            return req.spec_token_ids[:room]
        # The padded prompt tail: one prompt token left and prior state to continue from.
        if (self.num_spec and req.speculate and req.num_computed_tokens > 0
                and req.num_tokens - req.num_computed_tokens == 1 == n):
            k = min(room, self.config.max_model_len - req.num_tokens)
            return [PLACEHOLDER_TOKEN_ID] * max(k, 0)
        return []

    def _preempt(self, req: Request) -> None:
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.requeue(req)

    def requeue(self, req: Request) -> None:
        """Back to the front of the queue to be recomputed from its tokens, its cache freed (the caller has taken
        it out of `running`)."""
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_spec_in_flight = 0
        req.spec_token_ids = []
        req.num_accepted_tokens = 1
        req.snapshot_cuts, req.next_snapshot = [], 0
        self.waiting.appendleft(req)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]],
                           saved: list[bool] | None = None) -> list[Request]:
        """Advance the scheduled requests, append their sampled tokens, and finish those that stop.

        `sampled` holds each sampling request's new tokens: its accepted drafts, then one more. `saved`: which
        of the step's snapshot saves took. Returns the requests that got new tokens this step (finished ones
        included, with their status).
        """
        updated = []
        for s in out.scheduled:
            req = s.request
            if req.status.finished:  # aborted, or stopped by the step before, while the step ran
                continue
            if s.is_prefilling and req.status is RequestStatus.RUNNING:
                self.kv.cache_blocks(req, s.num_computed_tokens + s.num_tokens)  # a prompt chunk's cache is final
            tokens = sampled[req.request_id] if s.samples else []
            accepted = max(len(tokens) - 1, 0)
            req.num_output_placeholders -= s.samples
            if req.status is RequestStatus.RUNNING:  # not preempted since: it still holds the step's cache
                # Rejected drafts were computed but are not part of the sequence: the next step overwrites them.
                req.num_computed_tokens -= len(s.draft_token_ids) - accepted
                req.num_spec_in_flight -= len(s.draft_token_ids)
            req.num_accepted_tokens = 1 + accepted
            if self.num_spec:
                req.spec_token_ids = []
                real = sum(t != PLACEHOLDER_TOKEN_ID for t in s.draft_token_ids)
                for stats in (req.spec_stats, self.spec_stats):
                    if stats is not None:
                        stats.observe(real, min(accepted, real))
            if not s.samples:
                continue
            for token in tokens:
                req.output_token_ids.append(token)
                status = req.check_stop(token)
                if status is not None:
                    self.finish(req, status)
                    break
            updated.append(req)
        self.snapshots.settle(out, saved)  # after the tokens: a snapshot's key hashes the tokens before it
        return updated

    def discard_saves(self, out: SchedulerOutput) -> None:
        """The step failed: none of its snapshots is kept."""
        self.snapshots.settle(out, [False] * len(out.saves))

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Mark finished (stop, length or abort) and free everything the request holds; a request that ran to
        its end leaves its full blocks cached (every token but the last was computed)."""
        if req.status.finished:
            return
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH) \
                and req.status is RequestStatus.RUNNING:
            self.kv.cache_blocks(req, req.num_tokens - 1)
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
