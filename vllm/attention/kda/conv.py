"""Triton depthwise causal conv + SiLU over ragged rows, continuing from and updating a conv-state pool.

Used by KDA backends whose library has no conv in our state layout (fla-core keeps [N, C, W] states;
ours are the last W-1 inputs, [slots, C, W-1]). Two launches, because every program of a row reads the old
state before any program may overwrite it: `conv` reads x and old states, then `update_state` shifts the
row's last W-1 inputs into its slot. Row lengths come from the device offsets; max_query_len only sizes
the grid, so both launches are graph-safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T_TOTAL"])  # the step's token count: one kernel for all
def _conv_kernel(x_ptr, w_ptr, state_ptr, y_ptr, qsl_ptr, slot_ptr, init_ptr, C_SPLIT, T_TOTAL, stride_x,
                 stride_slot, stride_c, stride_w, W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK_T
    # Programs tile each split separately, so a block's output columns are contiguous in y [splits, T, C_SPLIT].
    blocks_per_split = tl.cdiv(C_SPLIT, BLOCK_C)
    split = tl.program_id(2) // blocks_per_split
    c_in = (tl.program_id(2) % blocks_per_split) * BLOCK_C + tl.arange(0, BLOCK_C)
    c = split * C_SPLIT + c_in
    start = tl.load(qsl_ptr + r)
    length = tl.load(qsl_ptr + r + 1) - start
    slot = tl.load(slot_ptr + r).to(tl.int64)
    if (t0 >= length) | (slot < 0):
        return
    t = t0 + tl.arange(0, BLOCK_T)
    c_ok = c_in < C_SPLIT
    t_ok = t < length
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for w in tl.static_range(W):
        j = t - (W - 1) + w  # the row-local input this tap reads; negative means the cached history
        tap = tl.load(x_ptr + (start + j)[:, None].to(tl.int64) * stride_x + c[None, :],
                      mask=(j >= 0)[:, None] & t_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        if t0 < W - 1:  # only a row's first tokens reach back into the cached history
            has_init = tl.load(init_ptr + r) != 0
            tap += tl.load(state_ptr + slot * stride_slot + c[None, :] * stride_c + (W - 1 + j)[:, None] * stride_w,
                           mask=((j < 0) & has_init)[:, None] & t_ok[:, None] & c_ok[None, :],
                           other=0.0).to(tl.float32)
        wt = tl.load(w_ptr + c * W + w, mask=c_ok, other=0.0).to(tl.float32)
        acc += tap * wt[None, :]
    y = acc * tl.sigmoid(acc)
    out = y_ptr + split.to(tl.int64) * T_TOTAL * C_SPLIT + (start + t)[:, None].to(tl.int64) * C_SPLIT
    tl.store(out + c_in[None, :], y.to(y_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])


@triton.jit
def _update_state_kernel(x_ptr, state_ptr, qsl_ptr, slot_ptr, init_ptr, C, stride_x, stride_slot, stride_c,
                         stride_w, W: tl.constexpr, WP: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    start = tl.load(qsl_ptr + r)
    length = tl.load(qsl_ptr + r + 1) - start
    slot = tl.load(slot_ptr + r).to(tl.int64)
    if (length == 0) | (slot < 0):
        return
    has_init = tl.load(init_ptr + r) != 0
    c_ok = c < C
    i = tl.arange(0, WP)
    j = length - (W - 1) + i  # new column i holds row-local input j, or an older history column if j < 0
    ok = c_ok[:, None] & (i < W - 1)[None, :]
    cols = state_ptr + slot * stride_slot + c[:, None] * stride_c
    from_x = tl.load(x_ptr + (start + j)[None, :].to(tl.int64) * stride_x + c[:, None],
                     mask=ok & (j >= 0)[None, :], other=0.0)
    hist = tl.load(cols + (W - 1 + j)[None, :] * stride_w, mask=ok & ((j < 0) & has_init)[None, :], other=0.0)
    new = tl.where((j >= 0)[None, :], from_x.to(tl.float32), hist.to(tl.float32))
    tl.debug_barrier()  # a short row shifts its history in place: every read lands before any write
    tl.store(cols + i[None, :] * stride_w, new.to(state_ptr.dtype.element_ty), mask=ok)


def causal_conv1d_silu(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                       query_start_loc: torch.Tensor, state_indices: torch.Tensor,
                       has_initial_state: torch.Tensor, max_query_len: int, num_splits: int = 1,
                       block_t: int = 32, block_c: int = 128, num_warps: int = 4) -> torch.Tensor:
    """x [T, C] (rows by query_start_loc [N+1]); weight [C, W]; conv_state [slots, C, W-1], updated in place, in
    either layout: channels-major (contiguous) or history-major (FlashInfer's, strides [slot, 1, C]).

    Returns SiLU(conv(x)) in x's dtype as [num_splits, T, C // num_splits]: with 3 splits q, k and v each come
    out contiguous, saving the copy a kernel wanting contiguous q/k/v would make. Rows with no tokens or a
    negative slot are skipped. block_t, block_c and num_warps are tuning knobs (same results).
    """
    T, C = x.shape
    W = weight.shape[1]
    N = state_indices.shape[0]
    assert x.stride(1) == 1 and conv_state.shape[1:] == (C, W - 1)
    if C % num_splits:
        raise ValueError(f"{C} channels do not split into {num_splits} equal parts")
    y = torch.empty(num_splits, T, C // num_splits, dtype=x.dtype, device=x.device)
    if N == 0 or T == 0:
        return y
    init = has_initial_state.to(torch.int8)
    # Two tile heights, not one per power of two of the chunk length: each BLOCK_T is a kernel of its own, and
    # serving meets new chunk lengths all the time; a variant first met there compiled mid-step (a stall of
    # every request in flight). Rows shorter than the tile are masked.
    block_t = 1 if max_query_len <= 1 else block_t
    grid = (N, triton.cdiv(max(max_query_len, 1), block_t), num_splits * triton.cdiv(C // num_splits, block_c))
    _conv_kernel[grid](x, weight, conv_state, y, query_start_loc, state_indices, init, C // num_splits, T,
                       x.stride(0), *conv_state.stride(), W=W, BLOCK_T=block_t, BLOCK_C=block_c,
                       num_warps=num_warps)
    _update_state_kernel[(N, triton.cdiv(C, 256))](x, conv_state, query_start_loc, state_indices, init, C,
                                                   x.stride(0), *conv_state.stride(), W=W,
                                                   WP=triton.next_power_of_2(W - 1), BLOCK_C=256)
    return y
