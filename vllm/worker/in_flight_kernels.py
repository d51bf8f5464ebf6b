"""in_flight_fill's CUDA form: one Triton program per descriptor row (see vllm.worker.in_flight_fill)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from vllm.core.sentinels import PLACEHOLDER_TOKEN_ID

if TYPE_CHECKING:
    from vllm.worker.in_flight_fill import FillSources, FillTargets


@triton.jit
def _fill_in_flight_kernel(desc_ptr, sampled_ptr, verified_ptr, drafts_ptr, ids_ptr, draft_ids_ptr, positions_ptr,
                           slot_ptr, seq_lens_ptr, accepted_ptr, block_table_ptr, verified_stride, verified_width,
                           drafts_stride, block_table_stride, block_size, HAS_BLOCKS: tl.constexpr,
                           NUM_FIELDS: tl.constexpr, PLACEHOLDER: tl.constexpr, BLOCK: tl.constexpr):
    # Field offsets as in FillField (constexpr enums do not reach a Triton kernel).
    d = desc_ptr + tl.program_id(0) * NUM_FIELDS
    row, anchor_pos, kind, src = tl.load(d), tl.load(d + 1), tl.load(d + 2), tl.load(d + 3)
    first, length, spec_in_flight = tl.load(d + 4), tl.load(d + 5), tl.load(d + 6)
    draft_pos, draft_src, draft_count = tl.load(d + 7), tl.load(d + 8), tl.load(d + 9)
    cols = tl.arange(0, BLOCK)
    if kind == 1:
        tl.store(ids_ptr + anchor_pos, tl.load(sampled_ptr + src).to(tl.int64))
    if kind == 2:
        emitted_row = tl.load(verified_ptr + src * verified_stride + cols, mask=cols < verified_width,
                              other=PLACEHOLDER)
        emitted = tl.sum((emitted_row != PLACEHOLDER).to(tl.int64), axis=0)  # >= 1
        tl.store(ids_ptr + anchor_pos, tl.load(verified_ptr + src * verified_stride + emitted - 1).to(tl.int64))
        shift = spec_in_flight - (emitted - 1)
        tl.store(accepted_ptr + row, emitted.to(tl.int32))
        tl.store(seq_lens_ptr + row, tl.load(seq_lens_ptr + row) - shift.to(tl.int32))
        in_row = cols < length
        pos = tl.load(positions_ptr + first + cols, mask=in_row, other=0) - shift
        tl.store(positions_ptr + first + cols, pos, mask=in_row)
        if HAS_BLOCKS:
            block = tl.load(block_table_ptr + row * block_table_stride + pos // block_size, mask=in_row, other=0)
            tl.store(slot_ptr + first + cols, block.to(tl.int64) * block_size + pos % block_size, mask=in_row)
    in_drafts = cols < draft_count
    drafts = tl.load(drafts_ptr + draft_src * drafts_stride + cols, mask=in_drafts, other=0).to(tl.int64)
    tl.store(ids_ptr + draft_pos + cols, drafts, mask=in_drafts)
    tl.store(draft_ids_ptr + draft_pos + cols, drafts, mask=in_drafts)


def fill_in_flight(device_desc: torch.Tensor, width: int, t: FillTargets, s: FillSources) -> None:
    """fill_in_flight in one launch over the descriptor rows on the device, `width` bounding a row's tokens,
    drafts and verified row."""
    # Absent sources are never read (no row names them); any tensor stands in for the pointer.
    sampled = s.sampled if s.sampled is not None else device_desc
    verified = s.verified if s.verified is not None else device_desc
    drafts = s.drafts if s.drafts is not None else device_desc
    _fill_in_flight_kernel[(device_desc.shape[0],)](
        device_desc, sampled, verified, drafts, t.input_ids, t.draft_ids, t.positions, t.slot_mapping, t.seq_lens,
        t.num_accepted, t.block_table, verified.stride(0), verified.shape[1] if s.verified is not None else 0,
        drafts.stride(0), t.block_table.stride(0), t.block_size, HAS_BLOCKS=t.has_blocks,
        NUM_FIELDS=device_desc.shape[1], PLACEHOLDER=PLACEHOLDER_TOKEN_ID,
        BLOCK=triton.next_power_of_2(width), num_warps=1)
