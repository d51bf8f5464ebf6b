"""in_flight_fill: the Triton kernel against the torch form on fresh random steps, and the torch form against
values worked out by hand."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from vllm.worker.in_flight_fill import FILL_FIELDS, AnchorKind, FillSources, FillTargets, fill_in_flight

DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                        reason="CPU tensors run through the Triton interpreter")),
           pytest.param("cuda", marks=pytest.mark.gpu)]


def random_step(rng: np.random.Generator, device: str, K: int, num_rows: int, block_size: int = 4):
    """A step of `num_rows` rows of 1..1+K tokens, each row drawn as one of: a sampled anchor, a verify row in
    flight (with or without device drafts), device drafts under a known anchor, nothing to fill."""
    lengths = rng.integers(1, K + 2, num_rows)
    firsts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    T = int(lengths.sum())
    num_sampled, num_verified = num_rows, num_rows
    sampled = torch.as_tensor(rng.integers(0, 1000, num_sampled), device=device)
    emitted = rng.integers(1, K + 2, num_verified)
    verified = torch.as_tensor(np.where(np.arange(K + 1)[None] < emitted[:, None],
                                        rng.integers(0, 1000, (num_verified, K + 1)), -1), device=device)
    drafts = torch.as_tensor(rng.integers(0, 1000, (num_rows, K)), device=device)
    desc = []
    for row in range(num_rows):
        first, length = int(firsts[row]), int(lengths[row])
        choice = rng.integers(0, 4)
        kind = [AnchorKind.SAMPLED, AnchorKind.VERIFIED, AnchorKind.NONE, AnchorKind.NONE][choice]
        if choice == 3:
            continue  # a row with nothing in flight
        anchor = first if kind != AnchorKind.NONE else -1
        src = int(rng.integers(0, num_sampled if kind == AnchorKind.SAMPLED else num_verified))
        # A verify row in flight emits at most 1 + its drafts: the row moves back by 0..spec tokens.
        spec = int(rng.integers(max(1, emitted[src] - 1), K + 1)) if kind == AnchorKind.VERIFIED else 0
        num_drafts = length - 1 if length > 1 and (choice == 2 or rng.random() < 0.7) else 0
        desc.append((row, anchor, int(kind), src if anchor >= 0 else 0, first, length, spec, first + 1,
                     int(rng.integers(0, num_rows)) if num_drafts else 0, num_drafts))
    if not desc:
        desc.append((0, 0, int(AnchorKind.SAMPLED), 0, 0, int(lengths[0]), 0, 1, 0, 0))
    positions = np.concatenate([np.arange(n) + rng.integers(K + 1, 40) for n in lengths])
    max_blocks = 16
    targets = FillTargets(
        input_ids=torch.as_tensor(rng.integers(0, 1000, T), device=device),
        draft_ids=torch.as_tensor(rng.integers(0, 1000, T), device=device),
        positions=torch.as_tensor(positions, device=device),
        slot_mapping=torch.as_tensor(rng.integers(0, 1000, T), device=device),
        seq_lens=torch.as_tensor(rng.integers(50, 60, num_rows), dtype=torch.int32, device=device),
        num_accepted=torch.as_tensor(rng.integers(0, 5, num_rows), dtype=torch.int32, device=device),
        block_table=torch.as_tensor(rng.integers(0, 500, (num_rows, max_blocks)), dtype=torch.int32, device=device),
        block_size=block_size, has_blocks=bool(rng.random() < 0.8))
    return np.array(desc, dtype=np.int64), targets, FillSources(sampled, verified, drafts)


def cloned(t: FillTargets) -> FillTargets:
    return FillTargets(*(x.clone() if isinstance(x, torch.Tensor) else x for x in
                         (t.input_ids, t.draft_ids, t.positions, t.slot_mapping, t.seq_lens, t.num_accepted,
                          t.block_table, t.block_size, t.has_blocks)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(10))
def test_the_kernel_fills_what_the_torch_form_fills(device, seed):
    rng = np.random.default_rng(seed)
    K = int(rng.integers(1, 8))
    desc, targets, sources = random_step(rng, device, K, num_rows=int(rng.integers(1, 12)))
    assert desc.shape[1] == FILL_FIELDS
    by_torch, by_kernel = cloned(targets), cloned(targets)
    fill_in_flight(desc, by_torch, sources, kernel=False)
    fill_in_flight(desc, by_kernel, sources, kernel=True)
    for name in ("input_ids", "draft_ids", "positions", "slot_mapping", "seq_lens", "num_accepted"):
        assert torch.equal(getattr(by_kernel, name), getattr(by_torch, name)), name
    assert not torch.equal(by_torch.input_ids, targets.input_ids)  # the step did fill something


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", [False, True])
def test_a_verify_row_in_flight_moves_back_by_its_rejected_drafts(kernel, device):
    """Row 0: a sampled anchor and two drafts. Row 1: it continues a verify row that had 3 drafts in flight, of
    which it kept 1 (emitted [7, 8]); the host placed it 2 tokens too far, so it moves back by 2."""
    desc = np.array([(0, 0, AnchorKind.SAMPLED, 1, 0, 3, 0, 1, 1, 2),
                     (1, 3, AnchorKind.VERIFIED, 0, 3, 3, 3, 4, 0, 2)], dtype=np.int64)
    with torch.device(device):  # the tensors below
        t = FillTargets(input_ids=torch.zeros(6, dtype=torch.int64), draft_ids=torch.full((6,), -2),
                        positions=torch.tensor([4, 5, 6, 12, 13, 14]),
                        slot_mapping=torch.zeros(6, dtype=torch.int64),
                        seq_lens=torch.tensor([7, 15], dtype=torch.int32),
                        num_accepted=torch.ones(2, dtype=torch.int32),
                        block_table=torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]], dtype=torch.int32), block_size=4,
                        has_blocks=True)
        s = FillSources(sampled=torch.tensor([100, 101]), verified=torch.tensor([[7, 8, -1, -1]]),
                        drafts=torch.tensor([[20, 21, 22], [30, 31, 32]]))
    fill_in_flight(desc, t, s, kernel=kernel)  # outside the device context, where host tensors stay on the host
    assert t.input_ids.tolist() == [101, 30, 31, 8, 20, 21]
    assert t.draft_ids.tolist() == [-2, 30, 31, -2, 20, 21]
    assert t.positions.tolist() == [4, 5, 6, 10, 11, 12]
    assert t.seq_lens.tolist() == [7, 13] and t.num_accepted.tolist() == [1, 2]
    # Row 1's moved tokens take their slots again from its table: positions 10, 11 in block 11, 12 in 12.
    assert t.slot_mapping.tolist()[3:] == [11 * 4 + 2, 11 * 4 + 3, 12 * 4 + 0]
