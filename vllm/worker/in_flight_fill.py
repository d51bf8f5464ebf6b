"""What a step's device inputs take from the step still in flight (fill_from_step, called by InputBatch.prepare).

Under async scheduling a step is prepared before the step before it has returned its tokens: the host writes
stand-ins, and the device copies in each row's newest token (sampled, or the last one a verify row emitted), its
DSpark drafts and, after a verify row, moves the row back by the drafts it rejected (the host placed the row as
if every draft in flight were accepted).

One row of the step per descriptor row (`FILL_FIELDS` int64 columns, `FillField`). On CUDA that is one Triton
launch: in torch it is ~35 small ops, each several microseconds of host time on the critical path of a
speculative step (the host prepares step N+1 while the device runs step N, so host time beyond the device's is
the step's time). The torch form runs elsewhere and is the kernel's reference in the tests.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm.core.sentinels import PLACEHOLDER_TOKEN_ID
from vllm.utils import async_tensor_h2d

try:
    from vllm.worker import in_flight_kernels
except ImportError:  # no triton (a CPU install): the torch form below
    in_flight_kernels = None

if TYPE_CHECKING:
    from vllm.worker.input_batch import CpuGpuBuffer

# The step in flight's sampled tokens on the device and each sampling request's row in them (what penalties
# count before the host has them).
InFlightTokens = tuple[torch.Tensor, dict[str, int]]


@dataclass(slots=True)
class InFlightStep:
    """The device outputs of the latest launched step, where a step prepared before their host copies are read
    finds what its host does not know: a row's newest token (sampled, or the last a verify row emitted), how
    many drafts a verify row kept, and the DSpark drafts proposed for the next step. Each dict maps a request to
    its row in the tensor beside it."""
    sampled: torch.Tensor | None = None  # [sample rows] int64
    sample_rows: dict[str, int] = field(default_factory=dict)
    verified: torch.Tensor | None = None  # [verify rows, 1 + K]: accepted drafts, then one more, then -1
    verify_rows: dict[str, int] = field(default_factory=dict)
    drafts: torch.Tensor | None = None  # [draft rows, K]
    draft_rows: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class DeviceFills:
    """Where a step's host buffers hold stand-ins for device values (fill_from_step), per row: (row, request,
    anchor token or -1, first token, tokens, drafts in flight, first device draft, device drafts) in step tokens
    (the fields of FillField, the request standing for its in-flight rows)."""
    rows: list[tuple[int, str, int, int, int, int, int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.rows)


class FillField(enum.IntEnum):
    ROW = 0  # the row in the step (its seq_lens, accepted count and block table row)
    ANCHOR_POS = 1  # the step token that takes the row's newest token, or -1
    ANCHOR_KIND = 2  # AnchorKind
    ANCHOR_SRC = 3  # the anchor's row in the in-flight sampled tokens or verified rows
    FIRST = 4  # the row's first token in the step
    LENGTH = 5  # the row's tokens
    SPEC_IN_FLIGHT = 6  # drafts of the verify row in flight the host placed the row after
    DRAFT_POS = 7  # the step token that takes the row's first device draft
    DRAFT_SRC = 8  # the row's row in the in-flight drafts
    DRAFT_COUNT = 9  # device drafts the row verifies (0: none)


FILL_FIELDS = len(FillField)


class AnchorKind(enum.IntEnum):
    NONE = 0  # the host has the row's newest token
    SAMPLED = 1  # a token sampled by the step in flight
    VERIFIED = 2  # the last token a verify row in flight emits; the row moves back by its rejected drafts


@dataclass(slots=True)
class FillTargets:
    """The step's persistent device buffers the fill writes."""
    input_ids: torch.Tensor  # [T] int64
    draft_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    seq_lens: torch.Tensor  # [R] int32
    num_accepted: torch.Tensor  # [R] int32
    block_table: torch.Tensor  # [R, max blocks] int32
    block_size: int
    has_blocks: bool  # recompute the slot mapping of moved tokens (a model with a paged cache)


@dataclass(slots=True)
class FillSources:
    """The step in flight's device outputs (None where it produced none)."""
    sampled: torch.Tensor | None  # [sample rows] int64
    verified: torch.Tensor | None  # [verify rows, 1 + K]: accepted drafts, then one more, then placeholders
    drafts: torch.Tensor | None  # [draft rows, K]


def fill_from_step(fills: DeviceFills, step: InFlightStep | None, targets: FillTargets,
                   desc_buffer: CpuGpuBuffer) -> None:
    """Copies into the step's device buffers what only the device knows, from `step` (the latest launched step's
    outputs), through descriptor rows written to `desc_buffer`."""
    if step is None:
        raise RuntimeError("a scheduled token is neither on the host nor on the device from the step before")
    rows, sample_rows, verify_rows, draft_rows = fills.rows, step.sample_rows, step.verify_rows, step.draft_rows
    n = len(rows)
    if all(a == i and not d and sample_rows.get(rid) == i for i, (_, rid, a, *_, d) in enumerate(rows)):
        # A decode step after a decode step, rows in the same order: one copy, nothing to upload.
        targets.input_ids[:n].copy_(step.sampled[:n])
        return
    desc = []
    for row, rid, anchor, first, length, spec, draft_pos, num_drafts in rows:
        if anchor < 0:
            kind, src = AnchorKind.NONE, 0
        elif rid in verify_rows:
            kind, src = AnchorKind.VERIFIED, verify_rows[rid]
        else:
            kind, src = AnchorKind.SAMPLED, sample_rows[rid]
        assert (kind == AnchorKind.VERIFIED) == (spec > 0), \
            "a row continues a verify row in flight, or has drafts in flight"
        desc.append((row, anchor, kind, src, first, length, spec, draft_pos,
                     draft_rows[rid] if num_drafts else 0, num_drafts))
    host_desc = desc_buffer.np[:len(desc)]
    host_desc[:] = desc
    fill_in_flight(host_desc, targets, FillSources(step.sampled, step.verified, step.drafts),
                   device_desc=desc_buffer.copy_to_device(len(desc)))


def fill_in_flight(desc: np.ndarray, targets: FillTargets, sources: FillSources,
                   device_desc: torch.Tensor | None = None, kernel: bool | None = None) -> None:
    """Applies the descriptor rows `desc` [n, FILL_FIELDS] to `targets` from `sources`: with `kernel` (by default
    on CUDA) in one Triton launch, which reads `device_desc` (desc's copy queued on the device; by default one is
    made here), else in the torch form."""
    if kernel is None:
        kernel = targets.input_ids.is_cuda and in_flight_kernels is not None
    if not kernel:
        fill_in_flight_torch(desc, targets, sources)
        return
    width = max(int(desc[:, FillField.LENGTH].max()), int(desc[:, FillField.DRAFT_COUNT].max()),
                sources.verified.shape[1] if sources.verified is not None else 1)
    if device_desc is None:
        device_desc = async_tensor_h2d(desc, torch.int64, targets.input_ids.device)
    in_flight_kernels.fill_in_flight(device_desc, width, targets, sources)


def fill_in_flight_torch(desc: np.ndarray, t: FillTargets, s: FillSources) -> None:
    """The torch form of fill_in_flight (the host selects the rows of each kind from `desc`)."""
    device = t.input_ids.device

    def index(a: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(a, dtype=torch.int64, device=device)

    F, kind = FillField, desc[:, FillField.ANCHOR_KIND]
    sampled = desc[kind == AnchorKind.SAMPLED]
    if len(sampled):
        t.input_ids[index(sampled[:, F.ANCHOR_POS])] = s.sampled[index(sampled[:, F.ANCHOR_SRC])]
    verified = desc[kind == AnchorKind.VERIFIED]
    if len(verified):
        rows = s.verified[index(verified[:, F.ANCHOR_SRC])]
        emitted = (rows != PLACEHOLDER_TOKEN_ID).sum(1)  # >= 1: a verify row emits its first token
        t.input_ids[index(verified[:, F.ANCHOR_POS])] = rows.gather(1, (emitted - 1)[:, None]).squeeze(1)
        shift = index(verified[:, F.SPEC_IN_FLIGHT]) - (emitted - 1)
        row = index(verified[:, F.ROW])
        t.num_accepted[row] = emitted.to(torch.int32)
        t.seq_lens[row] -= shift.to(torch.int32)
        lengths = verified[:, F.LENGTH]
        of = np.repeat(np.arange(len(verified)), lengths)
        tok = index(np.repeat(verified[:, F.FIRST], lengths) + _offsets_within(lengths))
        t.positions[tok] -= shift[index(of)]
        if t.has_blocks:
            pos = t.positions[tok]
            block = t.block_table[row[index(of)], pos // t.block_size].long()
            t.slot_mapping[tok] = block * t.block_size + pos % t.block_size
    drafted = desc[desc[:, F.DRAFT_COUNT] > 0]
    if len(drafted):
        counts = drafted[:, F.DRAFT_COUNT]
        within = _offsets_within(counts)
        tok = index(np.repeat(drafted[:, F.DRAFT_POS], counts) + within)
        drafts = s.drafts[index(np.repeat(drafted[:, F.DRAFT_SRC], counts)), index(within)]
        t.input_ids[tok] = drafts
        t.draft_ids[tok] = drafts


def _offsets_within(lengths: np.ndarray) -> np.ndarray:
    """0..n-1 for each n in lengths, concatenated."""
    total = int(lengths.sum())
    return np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
