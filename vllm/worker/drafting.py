"""Speculative drafts, ngram and DSpark, behind one `propose_drafts`.

ngram drafts on the host from each request's tokens, once a step's outputs have landed. DSpark drafts on the
device right after the target's forward (`draft_on_device`), anchored at each row's newest token; the drafts stay
there, where the next step's inputs take them, and the host learns only how many each request verifies next.
Either way a request never drafts past its max_tokens or --max-model-len.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from vllm.attention.backend import CommonAttentionMetadata
from vllm.config import VllmConfig
from vllm.core.request import Request
from vllm.core.scheduler import SchedulerOutput
from vllm.core.sentinels import DEVICE_DRAFT_TOKEN_ID
from vllm.model_executor.dspark_loader import load_dspark_draft
from vllm.spec_decode.adaptive_verification import DraftConfidences
from vllm.spec_decode.dspark import DSparkProposer
from vllm.spec_decode.ngram import NgramProposer
from vllm.utils import async_tensor_h2d
from vllm.worker.decode_tail import DecodeTail
from vllm.worker.outputs import AsyncModelRunnerOutput
from vllm.worker.sample_step import StepTokens

logger = logging.getLogger(__name__)


def load_dspark(config: VllmConfig, target: torch.nn.Module) -> DSparkProposer | None:
    """The DSpark draft over `target`, None without one."""
    spec, mc = config.speculative_config, config.model_config
    if spec is None or spec.method != "dspark":
        return None
    draft = load_dspark_draft(spec.model, mc.hf_config, mc.dtype, mc.device)
    if spec.enable_adaptive_verification and not draft.config.enable_confidence_head:
        raise ValueError(f"--speculative-config enable_adaptive_verification needs a draft with a confidence head; "
                         f"{spec.model} has enable_confidence_head=false")
    K = config.num_speculative_tokens
    logger.info("DSpark draft %s: %d layers over target layers %s, K=%d", spec.model,
                draft.config.num_hidden_layers, list(draft.config.target_layer_ids), K)
    sc = config.scheduler_config
    return DSparkProposer(draft, target, K, sc.max_num_batched_tokens, sc.max_num_seqs,
                          -(-sc.max_model_len // config.cache_config.block_size),
                          probabilistic=spec.draft_sample_method == "probabilistic")


def draft_room(req: Request) -> int:
    """A verify step emits up to 1 + drafts tokens, so drafts stop one short of the remaining max_tokens; each
    step in flight emits at least one."""
    return req.max_tokens - len(req.output_token_ids) - req.num_output_placeholders - 1


class Drafting:
    def __init__(self, config: VllmConfig, dspark: DSparkProposer | None) -> None:
        spec = config.speculative_config
        self.num_spec = config.num_speculative_tokens
        self.max_model_len = config.model_config.max_model_len
        self.ngram = NgramProposer.from_config(spec, self.max_model_len) \
            if spec is not None and spec.method == "ngram" else None
        self.dspark = dspark
        self.confidences = DraftConfidences(self.num_spec, config.model_config.device)

    def propose_drafts(self, running: Iterable[Request], launched: AsyncModelRunnerOutput | None) -> None:
        """Sets each running request's drafts for its next step. ngram: from the tokens on the host, called as a
        step's outputs land (`launched` None). DSpark: its share of the drafts `launched` (the step just queued)
        proposed on the device, as device-draft markers the input batch replaces; a request that step did not
        draft for has none (older drafts are gone with their step)."""
        if self.ngram is not None and launched is None:
            for req in running:
                room = draft_room(req)
                if req.speculate and not req.is_prefilling and room > 0:
                    req.spec_token_ids = self.ngram.propose(req.all_token_ids())[:room]
        elif self.dspark is not None and launched is not None:
            drafted = set(launched.draft_rows)
            for req in running:
                room = 0
                if req.request_id in drafted and not req.is_prefilling:
                    # The next row starts at num_computed_tokens, which counts drafts in flight as accepted.
                    room = min(draft_room(req), self.max_model_len - req.num_computed_tokens - 1, self.num_spec)
                req.spec_token_ids = [DEVICE_DRAFT_TOKEN_ID] * max(room, 0)

    @staticmethod
    def draft_probs_for(out: SchedulerOutput, last: AsyncModelRunnerOutput) -> torch.Tensor:
        """The distributions the step before sampled this step's verify rows' drafts from, [verify rows, K, V] in
        verify-row order (zeros for a row it did not draft: its drafts are placeholders, which q never weighs)."""
        index = {rid: i for i, rid in enumerate(last.draft_rows)}
        rows = [index.get(s.request.request_id, -1) for s in out.scheduled if s.draft_token_ids]
        probs = last.draft_probs
        if all(i >= 0 for i in rows):
            return probs[async_tensor_h2d(rows, torch.int64, probs.device)]
        padded = torch.cat([probs, probs.new_zeros(1, *probs.shape[1:])])
        return padded[async_tensor_h2d([i if i >= 0 else len(probs) for i in rows], torch.int64, probs.device)]

    def draft_on_device(self, out: SchedulerOutput, common: CommonAttentionMetadata, tokens: StepTokens,
                        tail: DecodeTail | None, positions: torch.Tensor, with_confidence: bool,
                        can_trim: Callable[[int, int], bool] | None, result: AsyncModelRunnerOutput) -> None:
        """DSpark drafts for the requests that sampled this step and may speculate, anchored at their newest
        token: a sampling row's token lands right after the row's last token; a verify row that emitted m tokens
        puts its last m after the row's first. Positions are read on the device, where they are exact (under
        async scheduling the host places a row after every draft in flight). Everything stays on the device.
        Where every row's tokens are the graph's greedy ones, the graph's anchors serve a step where every row
        drafts. `with_confidence`: adaptive verification reads the confidences; `can_trim(rows, tokens)`: whether
        its budget could trim the next all-verify step (their confidences then go to the host)."""
        picked = [(j, r) for j, r in enumerate(tokens.sample_rows) if out.scheduled[r].request.speculate]
        verify_rows = tokens.verify_rows
        rows = [r for _, r in picked] + verify_rows
        if not rows:
            return
        max_context = max(out.scheduled[r].num_computed_tokens + out.scheduled[r].num_tokens for r in rows)
        n = common.num_reqs
        if tokens.greedy_in_graph and tail.anchor_ids is not None and len(rows) == n:
            self._propose(out, range(n), tail.anchor_ids[:n], tail.anchor_pos[:n], common.block_table[:n],
                          max_context, with_confidence, can_trim, result)
            return
        # One upload: the picked rows' indices among the sampled tokens and their last tokens in the step, then
        # each row's step row (its block table; a verify row's first token is at its device offset).
        ends = common.query_start_loc_cpu
        p = len(picked)
        packed = async_tensor_h2d([j for j, _ in picked] + [int(ends[r + 1]) - 1 for _, r in picked] + rows,
                                  torch.int64, positions.device)
        step_rows = packed[2 * p:]
        anchors, anchor_pos = [], []
        if picked:
            anchors.append(tokens.sampled[packed[:p]])
            anchor_pos.append(positions[packed[p:2 * p]] + 1)
        if verify_rows:
            emitted = tokens.emitted()
            anchors.append(tokens.verified.gather(1, (emitted - 1)[:, None]).squeeze(1))
            first = common.query_start_loc[step_rows[p:]].long()
            anchor_pos.append(positions[first] + emitted)
        cat = (lambda ts: torch.cat(ts) if len(ts) > 1 else ts[0])
        self._propose(out, rows, cat(anchors), cat(anchor_pos), common.block_table[step_rows], max_context,
                      with_confidence, can_trim, result)

    def _propose(self, out: SchedulerOutput, rows, anchors: torch.Tensor, positions: torch.Tensor,
                 block_table: torch.Tensor, max_context: int, with_confidence: bool,
                 can_trim: Callable[[int, int], bool] | None, result: AsyncModelRunnerOutput) -> None:
        self.confidences.before_redraft()
        temperature = None
        if self.dspark.probabilistic:
            temps = [out.scheduled[r].request.sampling_params.temperature for r in rows]
            if any(t > 0 for t in temps):  # all greedy: argmax drafts, no distributions to keep
                temperature = async_tensor_h2d(temps, torch.float32, anchors.device)
        drafts, confidence, probs = self.dspark.propose(anchors, positions, block_table, max_context,
                                                        with_confidence=with_confidence, temperature=temperature)
        result.draft_rows = [out.scheduled[r].request.request_id for r in rows]
        result.drafts, result.draft_probs = drafts, probs
        if confidence is not None:
            # The rows drafted here are the next all-verify step's: its budget may not read their confidences.
            n = len(result.draft_rows)
            self.confidences.update(result.draft_rows, confidence,
                                    to_host=can_trim is None or can_trim(n, n * self.num_spec))
