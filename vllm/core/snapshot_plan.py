"""Where prefix caching takes KDA state snapshots (docs/prefix_caching.md): the prompt positions a chunk must end
on, the decode boundaries, the saves each step queues, and which of them are kept once the step's results say
which took. The scheduler asks it at admission, when it sizes a prompt chunk, after it builds a step, and with
the step's results."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.core.kv_cache_manager import KVCacheManager
from vllm.core.prefix_cache import CacheHit
from vllm.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from vllm.core.scheduler import SchedulerOutput

_KEEPS_SNAPSHOTS = (RequestStatus.RUNNING, RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


@dataclass(slots=True)
class SnapshotSave:
    """A copy of a row's KDA state at `position` (a block boundary) into snapshot `slot`, made after the step's
    forward. A prompt chunk ends there; a decode row may reach it, which the device decides (the host learns
    which saves took in the step's output, update_from_output)."""
    row: int
    position: int
    slot: int
    request: Request
    prefill: bool


class SnapshotPlan:
    def __init__(self, kv: KVCacheManager, interval: int) -> None:
        self.kv, self.interval = kv, interval
        # Snapshots are taken only where they can be found again: prefix caching over KDA layers.
        self.enabled = kv.prefix_caching and kv.needs_slots


    def admit(self, req: Request, hit: CacheHit | None) -> None:
        """At admission: where the prompt's chunks must end for a snapshot, and the first decode position that
        takes one. A prompt is cut only at the end of a long run of cached blocks without a snapshot (a shared
        prefix seen before, whose state exists nowhere yet); a prompt that ends on a block boundary leaves its
        state there; otherwise the first decode row past the prompt's last block leaves it, then one every
        snapshot interval (docs/prefix_caching.md)."""
        if not self.enabled:
            return
        bs, interval, end = self.kv.block_size, self.interval, req.num_tokens
        start = hit.num_tokens if hit is not None else 0
        shared = hit.num_cached_blocks * bs if hit is not None else 0
        req.snapshot_cuts = [c for c in (shared if shared - start >= interval else 0, end if end % bs == 0 else 0)
                             if start < c]
        req.next_snapshot = end + interval if end % bs == 0 else -(-end // bs) * bs

    def cut(self, req: Request, n: int, start: int | None = None) -> int:
        """n prompt tokens from `start` (the computed ones), cut at the first snapshot position inside them."""
        if req.snapshot_cuts and req.is_prefilling or start is not None:
            c = req.num_computed_tokens if start is None else start
            for cut in req.snapshot_cuts:
                if c < cut < c + n:
                    return cut - c
        return n

    def plan_saves(self, out: SchedulerOutput) -> None:
        """The snapshots this step takes: a prompt chunk that ends on a snapshot position, and a decode row that
        may reach its request's next decode position (its true start may be as many tokens back as it has
        drafts in flight; the device copies the state only if the row's accepted tokens reach it)."""
        for row, s in enumerate(out.scheduled):
            req = s.request
            end = s.num_computed_tokens + s.num_tokens
            if s.is_prefilling:
                position = end if end in req.snapshot_cuts else 0
            elif req.next_snapshot > end:  # most decode rows: the next boundary is further on
                continue
            else:
                b, first = req.next_snapshot, s.num_computed_tokens - s.num_spec_in_flight
                while 0 < b <= first:  # passed for sure without a save (no free slot then): the next one
                    b = req.next_snapshot = b + self.interval
                position = b if first < b <= end else 0
            if position:
                slot = self.kv.reserve_snapshot()
                if slot is not None:
                    out.saves.append(SnapshotSave(row, position, slot, req, s.is_prefilling))


    def settle(self, out: SchedulerOutput, saved: list[bool] | None) -> None:
        """Caches the snapshots the step took, frees the slots of those it did not. A request running (or that
        ran to its end) has not been preempted since the step (admission waits a step after a preemption), so
        its blocks hold the cache before the snapshot; one that stopped before the snapshot's position (on a
        stop token among accepted drafts) does not keep it."""
        assert saved is not None or not out.saves, "a step with snapshot saves reports which took"
        for save, took in zip(out.saves, saved or ()):
            req = save.request
            if took and req.status in _KEEPS_SNAPSHOTS and req.num_tokens >= save.position:
                self.kv.commit_snapshot(req, save.position, save.slot, decoding=not save.prefill)
                if not save.prefill and save.position == req.next_snapshot:
                    req.next_snapshot += self.interval
            else:
                self.kv.discard_snapshot(save.slot)
