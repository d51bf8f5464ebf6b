"""RecoverSSM (attention/kda/recover.py): verify rows record, the commit advances the state.

The commit repeats the recurrence's float operations: committing n recorded tokens gives exactly the state
kda_recurrent reached after them. On the torch backend a verify row in record mode leaves the pools untouched,
its outputs equal the checkpoint-column path's, and committing n tokens gives checkpoint column n - 1 (to an ulp:
the two paths batch their elementwise ops differently) for every n from 0 to the row's length. The Triton
commit kernel matches the torch commit for every count 0..Q, with float32 and bfloat16 activations and state,
snapshots included; the fused decode kernel's record mode then commits to exactly its own checkpoint columns
(CPU through Triton's interpreter).
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from kda_harness import random_inputs, random_layer, random_pools  # noqa: E402

from vllm.attention.kda.metadata import KDARows  # noqa: E402
from vllm.attention.kda.recover import KDARecords, allocate_records, commit_torch  # noqa: E402
from vllm.attention.kda.torch_ref import TorchKDABackend  # noqa: E402

H, D, W = 2, 8, 4
K = 3  # drafts: rows of up to Q = 1 + K tokens
Q = 1 + K
SLOTS = 24
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def rows_of(lens: list[int], slots, accepted=None, record=False) -> KDARows:
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(lens).cumsum(0)
    idx = torch.tensor(slots, dtype=torch.int32)
    ones = torch.ones(len(lens), dtype=torch.bool)
    return KDARows(query_start_loc=qsl, query_start_loc_cpu=qsl, state_indices=idx, state_indices_cpu=idx,
                   has_initial_state=ones, has_initial_state_cpu=ones, num_reqs=len(lens), num_tokens=sum(lens),
                   max_query_len=max(lens), record=record,
                   num_accepted_tokens=None if accepted is None else torch.tensor(accepted, dtype=torch.int32))


def stacked(records: KDARecords) -> KDARecords:
    return KDARecords(records.c[None], records.kd[None], records.x[None])


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("lens", [[1, 1, 1], [4, 1, 3, 2], [2, 4]])
def test_record_then_commit_equals_checkpoint_columns(lens, lower_bound):
    gen = torch.Generator().manual_seed(len(lens) * 7 + (lower_bound is None))
    layer = random_layer(H, D, W, lower_bound, "cpu", gen)
    conv, ssm = random_pools(layer, SLOTS, W, torch.float32, torch.float32, "cpu", gen)
    inputs = random_inputs(layer, sum(lens), torch.float32, "cpu", gen)
    perm = (torch.randperm(SLOTS - 1, generator=gen) + 1).tolist()
    own = perm[:len(lens)]  # RecoverSSM: one slot per request
    columns = [perm[len(lens) + Q * r:len(lens) + Q * (r + 1)] for r in range(len(lens))]
    for r, cols in enumerate(columns):  # the checkpointed run reads column 0 (accepted 1): the same state
        conv[cols[0]], ssm[cols[0]] = conv[own[r]], ssm[own[r]]

    ckpt_conv, ckpt_ssm = conv.clone(), ssm.clone()
    want = TorchKDABackend.forward_decode(layer, *inputs, ckpt_conv, ckpt_ssm,
                                          rows_of(lens, columns, accepted=[1] * len(lens)))

    records = allocate_records(1, SLOTS, H, D, 3 * H * D, Q, torch.float32, "cpu").layer(0)
    rec_conv, rec_ssm = conv.clone(), ssm.clone()
    got = TorchKDABackend.forward_decode(layer, *inputs, rec_conv, rec_ssm, rows_of(lens, own, record=True),
                                         records=records)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(rec_conv, conv) and torch.equal(rec_ssm, ssm), "a verify step wrote the state"

    for n in range(0, Q + 1):  # every count a row can commit (clipped to its length), 0 = not committed
        counts = [min(n, length) for length in lens]
        c2, s2 = rec_conv.clone(), rec_ssm.clone()
        commit_torch(c2[None], s2[None], stacked(records), torch.tensor(own, dtype=torch.int32),
                     torch.tensor(counts, dtype=torch.int32))
        for r, m in enumerate(counts):
            src = own[r] if m == 0 else columns[r][m - 1]
            expect_conv, expect_ssm = (conv, ssm) if m == 0 else (ckpt_conv, ckpt_ssm)
            # Shape-dependent vectorisation moves the gate and SiLU by an ulp between the two paths' batchings;
            # the commit itself repeats the recurrence exactly (test_commit_repeats_the_recurrence_exactly).
            torch.testing.assert_close(s2[own[r]], expect_ssm[src], rtol=1e-5, atol=1e-6, msg=f"{n=} {r=}")
            assert torch.equal(c2[own[r]], expect_conv[src]), (n, r)
        untouched = [s for s in range(SLOTS) if s not in own]
        assert torch.equal(s2[untouched], rec_ssm[untouched]) and torch.equal(c2[untouched], rec_conv[untouched])


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_commit_repeats_the_recurrence_exactly(lower_bound):
    from vllm.attention.kda.ops import kda_gate, kda_recurrent, l2norm
    gen = torch.Generator().manual_seed(11)
    layer = random_layer(H, D, W, lower_bound, "cpu", gen)
    q, k, v = (torch.randn(Q, H, D, generator=gen) for _ in range(3))
    q, k = l2norm(q), l2norm(k)
    g = kda_gate(torch.randn(Q, H * D, generator=gen), layer.A_log, layer.dt_bias, D, lower_bound)
    beta = torch.rand(Q, H, generator=gen)
    S0 = torch.randn(H, D, D, generator=gen) * 0.3
    checkpoints, corrections, decays = torch.empty(Q, H, D, D), torch.empty(Q, H, D), torch.empty(Q, H, D)
    kda_recurrent(q, k, v, g, beta, S0, checkpoints=checkpoints, corrections=corrections, decays=decays)
    rec = allocate_records(1, 2, H, D, 3 * H * D, Q, torch.float32, "cpu")
    rec.c[0, 1] = corrections.transpose(0, 1)
    rec.kd[0, 1] = torch.stack([k, decays], dim=2).transpose(0, 1)
    for n in range(1, Q + 1):
        ssm = torch.zeros(1, 2, H, D, D)
        ssm[0, 1] = S0
        commit_torch(torch.zeros(1, 2, 3 * H * D, W - 1), ssm, rec, torch.tensor([1], dtype=torch.int32),
                     torch.tensor([n], dtype=torch.int32))
        assert torch.equal(ssm[0, 1], checkpoints[n - 1]), n


def random_commit_case(L, N, act, state, device, gen):
    P = H * 16
    conv = torch.randn(L, SLOTS, 3 * P, W - 1, generator=gen).to(device, act)
    ssm = (torch.randn(L, SLOTS, H, 16, 16, generator=gen) * 0.3).to(device, state)
    rec = allocate_records(L, SLOTS, H, 16, 3 * P, Q, act, device)
    rec.c.copy_(torch.randn(rec.c.shape, generator=gen))
    rec.kd[..., 0, :] = torch.nn.functional.normalize(torch.randn(rec.kd[..., 0, :].shape, generator=gen), dim=-1)
    rec.kd[..., 1, :] = torch.rand(rec.kd[..., 1, :].shape, generator=gen) * 0.5 + 0.5
    rec.x.copy_(torch.randn(rec.x.shape, generator=gen))
    slots = (torch.randperm(SLOTS // 2, generator=gen)[:N] + 1).to(device, torch.int32)
    return conv, ssm, rec, slots


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act,state", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                       (torch.bfloat16, torch.bfloat16)])
def test_commit_kernel_matches_torch(device, act, state):
    from vllm.attention.kda.recover_kernel import commit_triton
    gen = torch.Generator().manual_seed(3)
    L, N = 2, Q + 1
    conv, ssm, rec, slots = random_commit_case(L, N, act, state, device, gen)
    counts = torch.arange(N, dtype=torch.int32, device=device)  # 0 (not committed) .. Q
    # Snapshots: rows 2 and 4 leave the state after 1 and 3 tokens in spare slots; row 1's asks past its count.
    snap_slots = torch.full((N,), -1, dtype=torch.int32, device=device)
    snap_counts = torch.zeros(N, dtype=torch.int32, device=device)
    spare = [SLOTS - 1, SLOTS - 2, SLOTS - 3]
    for row, m, dst in ((2, 1, spare[0]), (4, 3, spare[1]), (1, 2, spare[2])):
        snap_slots[row], snap_counts[row] = dst, m
    want_conv, want_ssm = conv.clone(), ssm.clone()
    commit_torch(want_conv, want_ssm, rec, slots, counts, snap_slots, snap_counts)
    commit_triton(conv, ssm, rec, slots, counts, snap_slots, snap_counts)
    # The kernel fuses c k^T into an FMA; torch (and the interpreter) round the product first.
    exact = state == torch.float32 and device == "cpu"
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-2, atol=1e-2) if state != torch.float32 else \
        dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ssm, want_ssm, **tol)
    torch.testing.assert_close(conv, want_conv, rtol=0, atol=0)
    assert not torch.equal(want_ssm[:, spare[0]], want_ssm[:, spare[2]])  # the taken snapshots were written


def test_commit_snapshot_is_the_state_after_its_tokens():
    gen = torch.Generator().manual_seed(5)
    conv, ssm, rec, slots = random_commit_case(2, 1, torch.float32, torch.float32, "cpu", gen)
    snap = torch.tensor([SLOTS - 1], dtype=torch.int32)
    for m in range(1, Q + 1):
        c1, s1 = conv.clone(), ssm.clone()
        commit_torch(c1, s1, rec, slots, torch.tensor([Q], dtype=torch.int32), snap, torch.tensor([m]))
        c2, s2 = conv.clone(), ssm.clone()
        commit_torch(c2, s2, rec, slots, torch.tensor([m], dtype=torch.int32))
        assert torch.equal(s1[:, SLOTS - 1], s2[:, slots[0]]) and torch.equal(c1[:, SLOTS - 1], c2[:, slots[0]])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split,state_dtype", [(1, torch.bfloat16), (2, torch.float32)])
def test_native_records_then_commit_equal_its_checkpoint_columns(device, split, state_dtype):
    """The fused decode kernel in record mode: same outputs as its checkpoint mode, pools untouched; the Triton
    commit of n tokens then equals checkpoint column n - 1."""
    from test_kda_native import make_case, shapes

    from vllm.attention.kda.native import fused_kda_decode
    from vllm.attention.kda.recover_kernel import commit_triton
    Hn, Kn = shapes(device)
    lens = [1, 4, 3, 2]
    case = make_case(lens, SLOTS, Hn, Kn, torch.bfloat16, state_dtype, device, seed=2)
    own = [3, 7, 1, 9]
    columns = [[10 + Q * r + t for t in range(Q)] for r in range(len(lens))]
    for r, cols in enumerate(columns):
        case["conv_state"][cols[0]], case["ssm_state"][cols[0]] = case["conv_state"][own[r]], case["ssm_state"][own[r]]
    idx = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    run = dict(num_heads=Hn, head_dim=Kn, max_query_len=Q, split=split)
    ckpt_conv, ckpt_ssm = case["conv_state"].clone(), case["ssm_state"].clone()
    want = fused_kda_decode(**{**case, "conv_state": ckpt_conv, "ssm_state": ckpt_ssm}, state_indices=idx(columns),
                            num_accepted_tokens=idx([1] * len(lens)), **run)
    records = allocate_records(1, SLOTS, Hn, Kn, 3 * Hn * Kn, Q, torch.bfloat16, device)
    conv, ssm = case["conv_state"].clone(), case["ssm_state"].clone()
    got = fused_kda_decode(**{**case, "conv_state": conv, "ssm_state": ssm}, state_indices=idx(own),
                           records=records.layer(0), **run)
    assert torch.equal(got, want)
    assert torch.equal(conv, case["conv_state"]) and torch.equal(ssm, case["ssm_state"]), "record mode wrote state"
    for n in range(Q + 1):
        counts = [min(n, length) for length in lens]
        c2, s2 = conv.clone(), ssm.clone()
        commit_triton(c2[None], s2[None], records, idx(own), idx(counts))
        for r, m in enumerate(counts):
            src = own[r] if m == 0 else columns[r][m - 1]
            ref_conv, ref_ssm = (conv, ssm) if m == 0 else (ckpt_conv, ckpt_ssm)
            assert torch.equal(c2[own[r]], ref_conv[src]), (n, r)
            torch.testing.assert_close(s2[own[r]], ref_ssm[src], rtol=0, atol=0, msg=f"{n=} {r=}")
