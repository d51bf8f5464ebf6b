"""Structured outputs' token masks on the device: bit t of a row's int32 words allows token t (xgrammar's
layout), applied to the sampler's logits before anything else reads them."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class GrammarBitmask:
    rows: torch.Tensor  # device int64 [n]: the constrained rows among the sampler's rows
    bitmask: torch.Tensor  # device int32 [n, ceil(V / 32)]


def apply_grammar_bitmask(logits: torch.Tensor, mask: GrammarBitmask) -> torch.Tensor:
    """The logits with every token a constrained row's grammar does not allow at -inf (a new tensor: the
    caller's logits may still be read elsewhere, e.g. for prompt logprobs)."""
    n, vocab = mask.bitmask.shape[0], logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((mask.bitmask.unsqueeze(-1) >> shifts) & 1).view(n, -1)[:, :vocab].bool()
    rows = logits.index_select(0, mask.rows).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, mask.rows, rows)
