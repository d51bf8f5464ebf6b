"""Structured outputs' token masks on the device: bit t of a row's int32 words allows token t (xgrammar's
layout), applied to the sampler's logits before anything else reads them."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class GrammarBitmask:
    rows: torch.Tensor  # device int64 [n]: the constrained rows among the sampler's rows
    bitmask: torch.Tensor  # device int32 [n, ceil(V / 32)]
    every_row: bool = False  # rows is 0..n-1 and n is every sampling row: no gather needed


def apply_grammar_bitmask(logits: torch.Tensor, mask: GrammarBitmask) -> torch.Tensor:
    """The logits with every token a constrained row's grammar does not allow at -inf (a new tensor: the
    caller's logits may still be read elsewhere, e.g. for prompt logprobs). xgrammar's kernel (Triton on CUDA, C++
    on CPU) masks in place: two or three launches where unpacking the bits in torch took ten."""
    import xgrammar as xgr
    if mask.every_row and mask.bitmask.shape[0] == logits.shape[0]:
        out = logits.clone()
        xgr.apply_token_bitmask_inplace(out, mask.bitmask)
        return out
    # The kernel reads bitmask row i for logits row i: the constrained rows are gathered, masked, scattered back.
    rows = logits.index_select(0, mask.rows)
    xgr.apply_token_bitmask_inplace(rows, mask.bitmask)
    return logits.index_copy(0, mask.rows, rows)
