"""Triton kernels of the fused MoE: (token, expert) pairs sorted by expert on the device, then two grouped GEMMs.

A *pair* is one (token, chosen expert) entry of the router's top-k, numbered token * top_k + j. The align
kernel lays the pairs out expert by expert, each expert's run padded to a whole number of BLOCK_M rows, so
that every BLOCK_M block of the sorted layout belongs to one expert. The GEMM grids are sized for the most
blocks any routing can need (known from the shapes alone); blocks past the routing's real count, read from the
device, return at once. So nothing reaches the host and one grid replays in a CUDA graph for any routing.
`num_pairs` changes every step, so Triton does not specialise it: a count that turned a multiple of 16 would
otherwise compile a second kernel in the middle of serving.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

ACT_SILU, ACT_SITU = tl.constexpr(0), tl.constexpr(1)  # constexpr: the kernels branch on them


@triton.jit(do_not_specialize=["num_pairs"])
def _align_kernel(ids_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr, num_pairs, num_experts,
                  BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, CHUNK: tl.constexpr):
    """Program e writes expert e's pairs, in pair order, at its padded offset, and its blocks' expert id.

    Every program histograms all pairs itself (one read of the ids per program, from L2) instead of a separate
    counting launch: at decode sizes the launch costs more than the reads."""
    e = tl.program_id(0)
    counts = tl.zeros([E_POW2], tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        idx = c0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + idx, mask=idx < num_pairs, other=-1)
        # an id outside [0, num_experts) is a choice this rank skips (expert parallelism's expert_map)
        counts += tl.histogram(ids, E_POW2, mask=(ids >= 0) & (ids < num_experts))
    experts = tl.arange(0, E_POW2)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(experts < e, padded, 0))
    mine = tl.sum(tl.where(experts == e, counts, 0))
    my_padded = tl.sum(tl.where(experts == e, padded, 0))
    if e == 0:
        tl.store(num_padded_ptr, tl.sum(tl.where(experts < num_experts, padded, 0)))
    for b in range(start // BLOCK_M, (start + my_padded) // BLOCK_M):
        tl.store(block_expert_ptr + b, e)
    seen = 0
    for c0 in range(0, num_pairs, CHUNK):
        idx = c0 + tl.arange(0, CHUNK)
        hit = tl.load(ids_ptr + idx, mask=idx < num_pairs, other=-1) == e
        rank = seen + tl.cumsum(hit.to(tl.int32), 0) - 1
        tl.store(sorted_pairs_ptr + start + rank, idx, mask=hit)
        seen += tl.sum(hit.to(tl.int32))
    pad = tl.arange(0, BLOCK_M)
    tl.store(sorted_pairs_ptr + start + mine + pad, num_pairs, mask=pad < my_padded - mine)


@triton.jit
def _block_rows(sorted_pairs_ptr, block_expert_ptr, num_padded_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """(pairs, valid, expert) of this program's block, or expert -1 when the block is past the routing's."""
    pid_m = tl.program_id(0)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    live = pid_m * BLOCK_M < tl.load(num_padded_ptr)
    pairs = tl.load(sorted_pairs_ptr + rows, mask=live, other=num_pairs)
    expert = tl.where(live, tl.load(block_expert_ptr + pid_m, mask=live, other=0), -1).to(tl.int64)
    return pairs, pairs < num_pairs, expert


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x, LIBDEVICE: tl.constexpr):
    # On a GPU, libdevice's: 2 * sigmoid(2x) - 1 with the fast exp cancels near 0, where the soft caps are about
    # linear (SiTU's up cap tanh(u / 25) lives there), and its ~1e-6 relative error flipped fp32 greedy tokens
    # against torch on the H200. Triton's interpreter has no libdevice; its exp is numpy's, exact enough.
    if LIBDEVICE:
        return libdevice.tanh(x)
    return 2.0 * _sigmoid(2.0 * x) - 1.0


@triton.jit
def _gate(g, u, situ_beta, situ_linear_beta, ACT: tl.constexpr, LIBDEVICE: tl.constexpr):
    """The experts' gated activation of fp32 gate and up values: SiLU(g) * u, or SiTU's soft-capped form."""
    if ACT == ACT_SITU:
        return (situ_beta * _tanh(g / situ_beta, LIBDEVICE) * _sigmoid(g)
                * (situ_linear_beta * _tanh(u / situ_linear_beta, LIBDEVICE)))
    return g * _sigmoid(g) * u


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_act_kernel(x_ptr, w13_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr, num_pairs,
                        K, INTER, stride_xm, stride_we, stride_wn, stride_om, situ_beta, situ_linear_beta,
                        TOP_K: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, LIBDEVICE: tl.constexpr):
    """out[pair, n] = act(x[token] . w13[e, n], x[token] . w13[e, INTER + n]): the gate and up columns of one
    tile in one program, so the gated activation runs on the fp32 accumulators and [pairs, 2 * INTER] never exists."""
    pairs, ok, expert = _block_rows(sorted_pairs_ptr, block_expert_ptr, num_padded_ptr, num_pairs, BLOCK_M)
    if expert < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < INTER
    k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + (pairs // TOP_K).to(tl.int64)[:, None] * stride_xm + k[None, :]
    g_ptrs = w13_ptr + expert * stride_we + n[None, :].to(tl.int64) * stride_wn + k[:, None]
    u_ptrs = g_ptrs + INTER * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + k < K
        a = tl.load(a_ptrs, mask=ok[:, None] & k_ok[None, :], other=0.0)
        acc_g = tl.dot(a, tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0), acc_g,
                       input_precision=PRECISION)
        acc_u = tl.dot(a, tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0), acc_u,
                       input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    act = _gate(acc_g, acc_u, situ_beta, situ_linear_beta, ACT, LIBDEVICE)
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + n[None, :]
    tl.store(out, act.to(out_ptr.dtype.element_ty), mask=ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _expert_gemm_kernel(a_ptr, w_ptr, out_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr,
                        num_pairs, K, N, stride_am, stride_we, stride_wn, stride_om,
                        A_ROW_DIV: tl.constexpr, SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """out[pair, n] = a[pair // A_ROW_DIV] . w[e, n], times weight[pair] with SCALE. The down GEMM (a: the
    activations, one row per pair, scaled by the routing weights; the caller sums a token's top_k rows, no
    atomics, so results do not depend on scheduling) and, for large routings, the gate/up GEMM over all 2I
    columns with one accumulator (a: the tokens, A_ROW_DIV = top_k; `_act_kernel` then gates)."""
    pairs, ok, expert = _block_rows(sorted_pairs_ptr, block_expert_ptr, num_padded_ptr, num_pairs, BLOCK_M)
    if expert < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // A_ROW_DIV).to(tl.int64)[:, None] * stride_am + k[None, :]
    b_ptrs = w_ptr + expert * stride_we + n[None, :].to(tl.int64) * stride_wn + k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + k < K
        a = tl.load(a_ptrs, mask=ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0), acc,
                     input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if SCALE:
        acc *= tl.load(weights_ptr + pairs, mask=ok, other=0.0)[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_sum_kernel(rows_ptr, out_ptr, D, stride_r, stride_o, TOP_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t] = the sum of rows[t * TOP_K + j] over j (a token's weighted expert rows; upstream's moe_sum), in
    float32 in a fixed order, rounded once to out's dtype. torch's strided sum over the middle dim took 4.8 us
    per MoE layer at one token on the H100: a generic reduction for [1, 5, 2048]."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = d < D
    acc = tl.zeros([BLOCK_D], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(rows_ptr + (t * TOP_K + j) * stride_r + d, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + d, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _act_kernel(gate_up_ptr, out_ptr, INTER, stride_g, stride_o, situ_beta, situ_linear_beta,
                ACT: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    """out[pair] = act(gate_up[pair, :INTER], gate_up[pair, INTER:]): the gating of the unfused gate/up path,
    the same function as the fused kernel's, on the GEMM's rounded outputs."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < INTER
    g = tl.load(gate_up_ptr + row * stride_g + n, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + row * stride_g + INTER + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + n, _gate(g, u, situ_beta, situ_linear_beta, ACT, LIBDEVICE)
             .to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _grouped_topk_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_logits, num_experts, scale,
                         TOP_K: tl.constexpr, K_POW2: tl.constexpr, NUM_GROUPS: tl.constexpr,
                         G_POW2: tl.constexpr, TOPK_GROUP: tl.constexpr, RENORMALIZE: tl.constexpr,
                         E_POW2: tl.constexpr, SHARED: tl.constexpr):
    """One token's routing: sigmoid scores, experts chosen by score + bias within the best groups (a group's
    strength is the sum of its two best), weights gathered from the scores, renormalised and scaled. The
    choice loops run TOP_K (and TOPK_GROUP) argmaxes over the token's experts in registers. SHARED: a last
    column choosing expert `num_experts` (the shared expert stacked after the routed ones) with weight 1."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_POW2)
    valid = e < num_experts
    score = tl.sigmoid(tl.load(logits_ptr + t * stride_logits + e, mask=valid, other=0.0))
    choice = tl.where(valid, score + tl.load(bias_ptr + e, mask=valid, other=0.0), float("-inf"))
    if NUM_GROUPS > 1:
        group = e // (num_experts // NUM_GROUPS)
        g = tl.arange(0, G_POW2)
        strength = tl.full([G_POW2], float("-inf"), tl.float32)
        for k in tl.static_range(NUM_GROUPS):
            mine = tl.where(group == k, choice, float("-inf"))
            best = tl.argmax(mine, 0)
            second = tl.max(tl.where(e == best, float("-inf"), mine), 0)
            # A one-expert group has no second best: its strength is its best alone.
            two = tl.max(mine, 0) + tl.where(second == float("-inf"), 0.0, second)
            strength = tl.where(g == k, two, strength)
        kept = tl.zeros([E_POW2], tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.argmax(strength, 0)
            kept = kept | (group == best)
            strength = tl.where(g == best, float("-inf"), strength)
        choice = tl.where(kept, choice, float("-inf"))
    j = tl.arange(0, K_POW2)
    ids = tl.zeros([K_POW2], tl.int64)
    weights = tl.zeros([K_POW2], tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.argmax(choice, 0)
        ids = tl.where(j == k, best, ids)
        weights = tl.where(j == k, tl.sum(tl.where(e == best, score, 0.0), 0), weights)
        choice = tl.where(e == best, float("-inf"), choice)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, 0) + 1e-20)
    row = TOP_K + SHARED
    tl.store(weights_ptr + t * row + j, weights * scale, mask=j < TOP_K)
    tl.store(ids_ptr + t * row + j, ids, mask=j < TOP_K)
    if SHARED:
        tl.store(weights_ptr + t * row + TOP_K, 1.0)
        tl.store(ids_ptr + t * row + TOP_K, num_experts)
