"""The decode tail: what a decode or verify graph computes past the model's forward.

In a step of decodes and verifies (no prompt chunk) every token is a logits row, so the graph that replays the
forward can also compute the logits of every (padded) token, their argmax, the greedy verification of every row
and, with a DSpark draft, each row's next anchor. The host then queues none of those ops itself: on a small model
a verify step's ~40 eager launches took longer on the host than the whole forward on the device (H200, built-in
model: `_verify` 0.97 ms of host time per step against 1.6 ms of device time for the step,
benchmarks/profile_spec_step.py). Steps whose sampling needs more than the argmax (random rows, penalties,
logprobs, biases) read `logits` and run the samplers eagerly as before.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.core.sentinels import PLACEHOLDER_TOKEN_ID
from vllm.sample.rejection_sampler import greedy_verify


@dataclass(slots=True)
class DecodeTail:
    hidden: torch.Tensor  # [T, D] the forward's output
    logits: torch.Tensor  # [T, V] float32, one row per token
    argmax: torch.Tensor  # [T] int64
    verified: torch.Tensor | None  # [R, 1 + K] greedy verification of each row (with speculation)
    # Under greedy verification, each row's newest token and its position (its first token's plus the tokens
    # it emits): where the DSpark draft anchors the row's next drafts (with a draft).
    anchor_ids: torch.Tensor | None
    anchor_pos: torch.Tensor | None


def decode_tail(hidden: torch.Tensor, logits: torch.Tensor, draft_ids: torch.Tensor, positions: torch.Tensor,
                query_start_loc: torch.Tensor, num_speculative_tokens: int, with_anchors: bool) -> DecodeTail:
    """The tail over `hidden` [T] and its `logits`; draft_ids, positions [>= T] and query_start_loc [R + 1] are
    the step's device inputs (placeholder drafts -1). Fixed shapes only: it is captured in graphs."""
    T = hidden.shape[0]
    argmax = logits.argmax(-1)
    verified = anchor_ids = anchor_pos = None
    if num_speculative_tokens:
        verified = greedy_verify(argmax, draft_ids[:T], query_start_loc, num_speculative_tokens)
    if with_anchors and verified is not None:
        start = query_start_loc[:-1].long().clamp(max=T - 1)
        emitted = (verified != PLACEHOLDER_TOKEN_ID).sum(1, keepdim=True)  # >= 1
        anchor_ids = verified.gather(1, emitted - 1).squeeze(1)
        anchor_pos = positions[start] + emitted.squeeze(1)
    return DecodeTail(hidden, logits, argmax, verified, anchor_ids, anchor_pos)
