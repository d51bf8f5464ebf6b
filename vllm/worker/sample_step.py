"""After the forward: one logits pass, then verification, sampling and prompt logprobs.

The rows that need logits are gathered once (the verify rows' tokens, the sampling rows' last tokens, the
positions whose prompt logprobs were asked for; their indices, the verify rows' offsets and the prompt targets
in ONE upload), `compute_logits` runs once over them (or they are read from the decode tail's logits, where a
graph computed every token's), and each consumer takes its slice. Rows the graph already verified greedily or
sampled by argmax need no logits at all.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm.attention.backend import CommonAttentionMetadata
from vllm.core.scheduler import SchedulerOutput
from vllm.core.sentinels import PLACEHOLDER_TOKEN_ID
from vllm.sample.grammar_bitmask import GrammarBitmask
from vllm.sample.rejection_sampler import RejectionSampler, SpecDecodeMetadata
from vllm.sample.sampler import Sampler, SamplingMetadata, gather_logprobs
from vllm.utils import async_tensor_d2h, async_tensor_h2d
from vllm.worker.decode_tail import DecodeTail
from vllm.worker.outputs import AsyncModelRunnerOutput, HostLogprobs


@dataclass(slots=True)
class StepTokens:
    """The step's new tokens on the device, for the drafter: which step rows sampled and which verified."""
    sample_rows: list[int]
    sampled: torch.Tensor | None  # [len(sample_rows)]
    verify_rows: list[int]
    verified: torch.Tensor | None  # [len(verify_rows), 1 + K]: accepted tokens, then placeholders
    greedy_in_graph: bool  # every row's tokens are the graph's greedy ones (its anchors are exact)
    _emitted: torch.Tensor | None = None

    def emitted(self) -> torch.Tensor:
        """Device int64 [len(verify_rows)]: the tokens each verify row emitted (its accepted drafts plus one), counted
        once for the step's consumers (the drafter's anchors, snapshot saves, RecoverSSM's commit)."""
        if self._emitted is None:
            self._emitted = (self.verified != PLACEHOLDER_TOKEN_ID).sum(1)
        return self._emitted


class SampleStep:
    def __init__(self, compute_logits, draft_ids: torch.Tensor, num_spec: int, vocab_size: int,
                 device: torch.device) -> None:
        self.compute_logits = compute_logits
        self.draft_ids = draft_ids  # the input batch's device draft ids (placeholders -1)
        self.num_spec, self.vocab_size, self.device = num_spec, vocab_size, device
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()

    def __call__(self, out: SchedulerOutput, common: CommonAttentionMetadata, hidden: torch.Tensor,
                 tail: DecodeTail | None, sampling: SamplingMetadata | None, spec_sampling: SamplingMetadata | None,
                 trimmed: list[int] | None, result: AsyncModelRunnerOutput,
                 draft_probs: torch.Tensor | None = None, grammar: GrammarBitmask | None = None) -> StepTokens:
        """Queues the step's verification, sampling and prompt logprobs into `result`. `trimmed`: the row lengths
        of an all-verify step the device re-cut (every token is then a logits row), else None. `draft_probs`:
        probabilistic drafts' distributions [verify rows, K, V] (None: drafts are deterministic). `grammar`: the
        structured-output masks of some sampling rows (their indices among the sampling rows)."""
        T = common.num_actual_tokens
        ends = common.query_start_loc_cpu[1:common.num_reqs + 1].tolist()
        sample_rows = [r for r, s in enumerate(out.scheduled) if s.samples and not s.draft_token_ids]
        verify_rows = [r for r, s in enumerate(out.scheduled) if s.draft_token_ids]
        verify_in_graph = bool(verify_rows) and tail is not None and tail.verified is not None \
            and spec_sampling.all_greedy
        sample_in_graph = bool(sample_rows) and tail is not None and sampling.argmax_only and grammar is None

        # The one upload: the logits rows, then the verify rows' graph rows or offsets, the sampling rows' graph
        # rows, the prompt targets; consumed in that order below.
        parts: list = []
        drafts = []
        if verify_rows and not verify_in_graph and trimmed is None:
            drafts = [len(out.scheduled[r].draft_token_ids) for r in verify_rows]
            parts += [np.arange(ends[r] - d - 1, ends[r]) for r, d in zip(verify_rows, drafts)]
        elif verify_rows and not verify_in_graph:  # the re-cut all-verify step: every token, in order
            parts.append(np.arange(T))
        num_verify_logits = sum(len(p) for p in parts)
        num_sample_logits = len(sample_rows) if sample_rows and not sample_in_graph else 0
        # A decode step (every token a sampling row, in order) gathers nothing: nothing to upload for it.
        sample_gather = num_sample_logits and not (num_sample_logits == T and not verify_rows)
        if sample_gather:
            parts.append(np.array([ends[r] - 1 for r in sample_rows]))
        prompt = self._prompt_rows(out, ends) if self.any_prompt_logprobs(out) else []
        parts += [np.arange(first, first + len(targets)) for _, first, targets, _ in prompt]
        num_logits = num_verify_logits + num_sample_logits + sum(len(t) for _, _, t, _ in prompt)
        if verify_in_graph and len(verify_rows) < common.num_reqs:
            parts.append(np.array(verify_rows))  # the verify rows among the graph's rows
        if drafts:
            parts.append(np.concatenate([[0], np.cumsum(np.add(drafts, 1))]))
        gather_argmax = sample_in_graph and len(sample_rows) < T
        if gather_argmax:
            parts.append(np.array([ends[r] - 1 for r in sample_rows]))  # the sampling rows among its tokens
        parts += [targets for _, _, targets, _ in prompt]
        packed = async_tensor_h2d(np.concatenate(parts), torch.int64, self.device) if parts else None
        # Every token a verify token, or a sampling row, in step order (then no prompt position has logits).
        every_token = num_verify_logits == T or (num_sample_logits == T and not sample_gather)
        logits = None
        if num_logits:
            # A step whose logits rows are its tokens in order needs no gather (a decode step, a re-cut verify).
            rows = None if every_token else packed[:num_logits]
            if tail is not None:
                logits = tail.logits[:T] if rows is None else tail.logits[rows]
            else:
                logits = self.compute_logits(hidden if rows is None else hidden[rows])
        at = num_logits

        verified = None
        if verify_in_graph:  # the graph verified every row greedily
            verified = tail.verified[:common.num_reqs]
            if len(verify_rows) < common.num_reqs:
                verified = verified[packed[at:at + len(verify_rows)]]
                at += len(verify_rows)
            self._queue_verified(out, verify_rows, verified, result)
        elif verify_rows:
            if trimmed is not None:
                token_idx = torch.arange(T, device=self.device)
                cu, drafts = common.query_start_loc, [n - 1 for n in trimmed]
            else:
                token_idx = packed[:num_verify_logits]
                cu = packed[at:at + len(drafts) + 1].int()
                at += len(drafts) + 1
            verified = self._verify(out, logits[:num_verify_logits], verify_rows, token_idx, cu, drafts,
                                    spec_sampling, result, draft_probs)

        if gather_argmax:
            argmax_rows = packed[at:at + len(sample_rows)]
            at += len(sample_rows)
        sampled = None
        if sample_rows:
            if sample_in_graph:  # the graph took the argmax of every token
                sampled = tail.argmax[argmax_rows] if gather_argmax else tail.argmax[:T]
            else:
                s = self.sampler(logits[num_verify_logits:num_verify_logits + num_sample_logits], sampling, grammar)
                sampled = s.sampled_token_ids
                if s.logprobs is not None:
                    result.logprobs_host = HostLogprobs.queue(s.logprobs)
            result.sampled_token_ids = sampled
            result.sampled_host = async_tensor_d2h(sampled)
            for j, r in enumerate(sample_rows):
                req = out.scheduled[r].request
                result.sample_rows[req.request_id] = j
                k = req.sampling_params.logprobs
                result.sample_logprob_ks.append(self.vocab_size if k == -1 else k)

        if prompt:
            first_row = num_verify_logits + num_sample_logits
            logprobs = logits[first_row:num_logits].log_softmax(-1)
            row = 0
            for rid, _, targets, k in prompt:
                n = len(targets)
                k = logprobs.shape[-1] if k == -1 else k  # -1: the whole vocabulary
                result.prompt_logprobs_host[rid] = HostLogprobs.queue(
                    gather_logprobs(logprobs[row:row + n], packed[at:at + n], k))
                row, at = row + n, at + n
        return StepTokens(sample_rows, sampled, verify_rows, verified,
                          greedy_in_graph=tail is not None and (sample_in_graph or not sample_rows)
                          and (verify_in_graph or not verify_rows))

    @staticmethod
    def any_prompt_logprobs(out: SchedulerOutput) -> bool:
        return any(s.request.sampling_params.prompt_logprobs is not None for s in out.scheduled)

    @staticmethod
    def _prompt_rows(out: SchedulerOutput, ends: list[int]) -> list[tuple[str, int, np.ndarray, int]]:
        """(request, its first logits row in the step, the prompt tokens those rows predict, top-k) for each row
        that asked for prompt logprobs and covers prompt positions with a successor."""
        rows = []
        for r, s in enumerate(out.scheduled):
            req = s.request
            k = req.sampling_params.prompt_logprobs
            n_prompt = len(req.prompt_token_ids)
            start = s.num_computed_tokens
            if k is None or start >= n_prompt:
                continue
            # Row t predicts prompt token t+1; a chunk covering positions [start, end) scores [start+1, end].
            end = min(start + s.num_tokens, n_prompt - 1)
            if end > start:
                rows.append((req.request_id, ends[r] - s.num_tokens,
                             np.asarray(req.prompt_token_ids[start + 1:end + 1]), k))
        return rows

    def _queue_verified(self, out: SchedulerOutput, rows: list[int], verified: torch.Tensor,
                        result: AsyncModelRunnerOutput) -> None:
        result.verify_rows = [out.scheduled[r].request.request_id for r in rows]
        result.verified = verified
        result.verified_host = async_tensor_d2h(verified)

    def _verify(self, out: SchedulerOutput, logits: torch.Tensor, rows: list[int], token_idx: torch.Tensor,
                cu_num_logits: torch.Tensor, num_draft_tokens: list[int], sampling: SamplingMetadata,
                result: AsyncModelRunnerOutput, draft_probs: torch.Tensor | None = None) -> torch.Tensor:
        """Rejection-sample the verify `rows`; returns their tokens [rows, 1 + K] (accepted, then placeholders).
        token_idx (device) lists each row's tokens in the step (its current token, then its drafts), each one a
        row of `logits`; cu_num_logits (device) cuts them into rows. The drafts are read from the input batch's
        device draft ids (placeholders still -1), so nothing is uploaded again; the host draft counts have the
        device total and only size the output."""
        # index_fill_, not `first[idx] = True`: that assignment copies its scalar from pageable host memory,
        # which makes the host wait for the whole forward before it queues the rest of the step.
        first = torch.zeros(token_idx.shape[0], dtype=torch.bool, device=self.device)
        first.index_fill_(0, cu_num_logits[:-1].long(), True)
        draft_rows = (~first).nonzero_static(size=sum(num_draft_tokens)).squeeze(1)  # no host sync
        drafts = self.draft_ids[token_idx[draft_rows]]
        meta = SpecDecodeMetadata(drafts, num_draft_tokens, cu_num_logits)
        tokens = self.rejection_sampler(logits, draft_probs, meta, sampling, max_spec_len=self.num_spec)
        self._queue_verified(out, rows, tokens, result)
        return tokens
