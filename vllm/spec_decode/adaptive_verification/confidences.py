"""DraftConfidences: the drafter's confidences, on the device and (one step stale) on the host."""
from __future__ import annotations

import numpy as np
import torch

from vllm.utils import async_tensor_h2d


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
