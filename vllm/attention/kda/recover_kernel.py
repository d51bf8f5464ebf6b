"""RecoverSSM's commit in Triton: one launch over (rows, KDA layers, heads), see recover.py for the math.

A program owns one (row, layer, head): it streams the head's state rows through registers in blocks of BV, runs
the row's recorded tokens on each block (the same two operations the verify ran: decay, then an FMA of c k^T) and
stores the block once; it then moves the head's q, k and v conv channels n inputs along. Programs touch disjoint
memory, so there is no ordering between them. Row counts come from the device: the launch is graph-safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.attention.kda.recover import KDARecords

BLOCK_V = 32


@triton.jit
def _commit_kernel(conv_ptr, ssm_ptr, c_ptr, kd_ptr, x_ptr, slot_ptr, n_ptr, snap_slot_ptr, snap_n_ptr,
                   s_conv_l, s_conv_slot, s_conv_c, s_conv_w, s_ssm_l, s_ssm_slot, s_c_l, s_c_slot, s_kd_l,
                   s_kd_slot, s_x_l, s_x_slot, s_x_t,
                   P: tl.constexpr, K: tl.constexpr, Q: tl.constexpr, WM1: tl.constexpr, WP: tl.constexpr,
                   BV: tl.constexpr, SNAP: tl.constexpr):
    r = tl.program_id(0)
    lyr = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    n = tl.minimum(tl.load(n_ptr + r), Q)
    if n <= 0:
        return
    slot = tl.load(slot_ptr + r).to(tl.int64)
    m = 0
    snap = slot
    if SNAP:
        snap = tl.load(snap_slot_ptr + r).to(tl.int64)
        m = tl.load(snap_n_ptr + r)
        m = tl.where((snap >= 0) & (m >= 1) & (m <= n), m, 0)
    offs = tl.arange(0, K)
    block = tl.arange(0, BV)
    state = ssm_ptr + lyr * s_ssm_l + h * K * K
    c_base = c_ptr + lyr * s_c_l + slot * s_c_slot + h * Q * K
    kd_base = kd_ptr + lyr * s_kd_l + slot * s_kd_slot + h * Q * 2 * K
    for b in tl.static_range(K // BV):
        rows = b * BV + block
        tile = rows[:, None] * K + offs[None, :]
        S = tl.load(state + slot * s_ssm_slot + tile).to(tl.float32)
        for t in tl.static_range(Q):
            live = t < n
            k = tl.load(kd_base + t * 2 * K + offs, mask=live, other=0.0)
            d = tl.load(kd_base + (t * 2 + 1) * K + offs, mask=live, other=1.0)
            c = tl.load(c_base + t * K + rows, mask=live, other=0.0)
            step = S * d[None, :]
            step = tl.fma(c[:, None], k[None, :], step)  # the decode kernel's operation, contracted alike
            S = tl.where(live, step, S)
            if SNAP:
                tl.store(state + snap * s_ssm_slot + tile, S.to(ssm_ptr.dtype.element_ty), mask=m == t + 1)
        tl.store(state + slot * s_ssm_slot + tile, S.to(ssm_ptr.dtype.element_ty))

    # Conv windows of the head's q, k and v channels: column j becomes input n + j of [old window, x_1..x_Q].
    j = tl.arange(0, WP)[None, :]
    x_base = x_ptr + lyr * s_x_l + slot * s_x_slot
    conv = conv_ptr + lyr * s_conv_l
    for g in tl.static_range(3):
        ch = g * P + h * K + offs[:, None]
        old = conv + slot * s_conv_slot + ch * s_conv_c
        src = n + j
        from_old = tl.load(old + src * s_conv_w, mask=(src < WM1) & (j < WM1), other=0.0)
        from_x = tl.load(x_base + (src - WM1) * s_x_t + ch, mask=(src >= WM1) & (j < WM1), other=0.0)
        new = tl.where(src < WM1, from_old, from_x.to(from_old.dtype))
        if SNAP:
            src_m = m + j
            snap_old = tl.load(old + src_m * s_conv_w, mask=(src_m < WM1) & (j < WM1) & (m > 0), other=0.0)
            snap_x = tl.load(x_base + (src_m - WM1) * s_x_t + ch, mask=(src_m >= WM1) & (j < WM1) & (m > 0),
                             other=0.0)
            snap_new = tl.where(src_m < WM1, snap_old, snap_x.to(snap_old.dtype))
        tl.debug_barrier()  # every read of the old window lands before it is overwritten
        tl.store(old + j * s_conv_w, new, mask=j < WM1)
        if SNAP:
            tl.store(conv + snap * s_conv_slot + ch * s_conv_c + j * s_conv_w, snap_new, mask=(j < WM1) & (m > 0))


def commit_triton(conv_state: torch.Tensor, ssm_state: torch.Tensor, records: KDARecords, slots: torch.Tensor,
                  counts: torch.Tensor, snap_slots: torch.Tensor | None = None,
                  snap_counts: torch.Tensor | None = None, block_v: int = BLOCK_V, num_warps: int = 4) -> None:
    """recover.commit on the device (same contract)."""
    L, _, H, V, K = ssm_state.shape
    C, WM1 = conv_state.shape[2:]
    Q = records.record_len
    assert V == K and K & (K - 1) == 0, "power-of-two square head states"
    assert C == 3 * H * K and records.x.stride(-1) == 1 and records.x.shape[-1] == C
    assert ssm_state[0, 0].is_contiguous() and records.c[0, 0].is_contiguous() and records.kd[0, 0].is_contiguous()
    N = slots.shape[0]
    if N == 0 or L == 0:
        return
    snap = snap_slots is not None
    _commit_kernel[(N, L, H)](
        conv_state, ssm_state, records.c, records.kd, records.x, slots, counts,
        snap_slots if snap else slots, snap_counts if snap else counts,
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), conv_state.stride(3),
        ssm_state.stride(0), ssm_state.stride(1), records.c.stride(0), records.c.stride(1),
        records.kd.stride(0), records.kd.stride(1), records.x.stride(0), records.x.stride(1), records.x.stride(2),
        P=H * K, K=K, Q=Q, WM1=WM1, WP=triton.next_power_of_2(WM1), BV=min(block_v, K), SNAP=snap,
        num_warps=num_warps)
