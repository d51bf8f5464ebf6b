"""KDA state snapshots on the device: the copies between a request's state slot and a snapshot slot that prefix
caching plans (core/snapshot_plan.py).

A restore copies a cached snapshot into the state slot of a request admitted with that prefix, before the step's
forward. A save copies, after the forward, the state a row holds at a block boundary: the row's last state for a
prompt chunk that ends there; for a decode or verify row, the checkpoint column of the token before the
boundary, if the row reached it (under RecoverSSM, the state its commit passes there: recover.py). Where the row
really starts is known on the device only (async scheduling places a row as if every draft in flight were
accepted), and so is how many drafts it kept: the device works out the column and whether the save took, and the
host learns which in the step's output. Every copy is a fixed-count index_select / index_copy_ per stacked state
pool, queued without a host sync, outside the graphs.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm.utils import async_tensor_h2d

if TYPE_CHECKING:
    from vllm.attention.backend import CommonAttentionMetadata
    from vllm.core.snapshot_plan import SnapshotSave
    from vllm.worker.sample_step import StepTokens


class StateSnapshots:
    def __init__(self, pools: Sequence[torch.Tensor], device: torch.device, recover: bool = False) -> None:
        self.pools = list(pools)  # the KDA layers' conv and recurrent state pools, stacked: [layers, slots, ...]
        self.device = device
        self.recover = recover  # RecoverSSM: a decode row's state exists after its commit only (recover.py)

    def _copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for pool in self.pools:
            pool.index_copy_(1, dst, pool.index_select(1, src))

    def restore(self, pairs: list[tuple[int, int]]) -> None:
        """Copies each (snapshot slot, request slot) pair."""
        if not pairs or not self.pools:
            return
        idx = async_tensor_h2d(np.asarray(pairs, dtype=np.int64).T.reshape(-1), torch.int64, self.device)
        self._copy(idx[:len(pairs)], idx[len(pairs):])

    def save(self, saves: list[SnapshotSave], common: CommonAttentionMetadata, positions: torch.Tensor,
             tokens: StepTokens) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """Queues the saves; returns, on the device, which took (bool per save), and under RecoverSSM the
        decode rows' saves for the commit to make: (snapshot slot or -1, tokens of the row before it) per row."""
        if not saves or not self.pools:
            return None, None
        verify_index = {row: i for i, row in enumerate(tokens.verify_rows)}
        host = np.array([(s.row, s.position, s.slot, s.prefill, verify_index.get(s.row, -1)) for s in saves],
                        dtype=np.int64)
        row, boundary, dst, prefill, vi = async_tensor_h2d(host, torch.int64, self.device).unbind(1)
        qsl = common.query_start_loc.long()
        length = qsl[row + 1] - qsl[row]
        col = boundary - 1 - positions[qsl[row]]  # the row's token before the boundary
        # How far the row's state is right: a verify row's accepted tokens, every token of another row.
        reach = length
        if tokens.verified is not None and tokens.verify_rows:
            emitted = tokens.emitted()
            reach = torch.where(vi >= 0, emitted[vi.clamp(min=0)], length)
        slots = common.state_indices.long()
        last = col == length - 1
        if slots.dim() == 2:  # checkpoint columns: a decode row's state after token t is in column t
            prefill = prefill.bool()
            src = slots[row, torch.where(prefill, 0, col.clamp(0, slots.shape[1] - 1))]
            took = torch.where(prefill, last, (col >= 0) & (col < reach))
        elif self.recover:  # a prompt chunk's state is in its slot; a decode row's save rides its commit
            prefill = prefill.bool()
            took = torch.where(prefill, last, (col >= 0) & (col < reach))
            src = torch.where(prefill, slots[row], dst)  # decode saves copy their target onto itself: no-op
            n = common.num_reqs
            snap_slot = torch.full((n,), -1, dtype=torch.int32, device=self.device)
            snap_len = torch.zeros(n, dtype=torch.int32, device=self.device)
            snap_slot[row] = torch.where(took & ~prefill, dst, -1).int()
            snap_len[row] = (col + 1).int()
            self._copy(src, dst)
            return took, (snap_slot, snap_len)
        else:  # one state per row: its state after the row's last token
            src = slots[row]
            took = last & (col < reach)
        self._copy(src, dst)
        return took, None
