"""RecoverSSM's commit after the sample step: how many tokens each row keeps, then one launch (recover.py).

A verify row keeps its accepted drafts plus the token before them (what the rejection sampler emitted, on the
device); another decode row its one token; a prompt chunk nothing (it wrote its state itself). The counts never
reach the host: for a step of verify rows only they are the emitted counts as they are, for a step of one-token
decode rows a kept tensor of ones; otherwise a host row template is uploaded with the verify rows' positions in
it, and the emitted counts scattered in.
"""
from __future__ import annotations

import torch

from vllm.attention.backend import CommonAttentionMetadata
from vllm.attention.kda.recover import commit
from vllm.utils import async_tensors_h2d
from vllm.worker.sample_step import StepTokens


class StateCommit:
    def __init__(self, conv_state: torch.Tensor, ssm_state: torch.Tensor, records, device: torch.device) -> None:
        self.conv_state, self.ssm_state, self.records, self.device = conv_state, ssm_state, records, device
        self._ones: torch.Tensor | None = None  # a decode step's counts, kept

    def counts(self, common: CommonAttentionMetadata, tokens: StepTokens) -> torch.Tensor:
        """Device int32 [num_reqs]: the tokens each row commits."""
        n = common.num_reqs
        verify = tokens.verify_rows
        if len(verify) == n:  # every row verifies (rows are in step order)
            return tokens.emitted().int()
        prefilling = common.is_prefilling[:n].numpy()
        if not verify and not prefilling.any():  # a decode step: every row keeps its one token
            if self._ones is None or self._ones.shape[0] < n:
                self._ones = torch.ones(max(n, 256), dtype=torch.int32, device=self.device)
            return self._ones[:n]
        keeps, verify_rows = async_tensors_h2d([~prefilling, verify], self.device)
        counts = keeps.int()
        if verify:
            counts[verify_rows] = tokens.emitted().int()
        return counts

    def __call__(self, common: CommonAttentionMetadata, tokens: StepTokens,
                 snapshots: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Commits the step's rows; `snapshots` (StateSnapshots.save): decode rows' snapshot slots and positions."""
        if common.num_reqs == 0:
            return
        snap_slots, snap_counts = snapshots if snapshots is not None else (None, None)
        commit(self.conv_state, self.ssm_state, self.records, common.state_indices[:common.num_reqs],
               self.counts(common, tokens), snap_slots, snap_counts)
