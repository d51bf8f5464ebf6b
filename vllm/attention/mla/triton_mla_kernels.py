"""Triton kernels of the TRITON_MLA backend: the latent-cache write, split-KV absorbed attention, the split merge.

Absorbed MLA is MQA in latent space: every head of a request scores the same cache row
[c_kv (L) | k_rope (R)]. So one attention program takes BLOCK_M query rows of one request, flattened as
token * H + head, and reads each cache tile once for all of them (c_kv serves as both K and V). The
context is cut into `num_splits` ranges computed in-kernel from the device lengths (flash-decoding), so a
fixed grid serves any lengths, as a CUDA graph needs; a merge kernel joins the splits by log-sum-exp.
Scores run in base 2 (exp2/log2), with the softmax scale folded into log2(e).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm.utils import num_sms


@triton.jit
def _write_latent_kernel(latent_ptr, cache_ptr, slot_ptr, stride_latent, stride_blk, stride_off,
                         D: tl.constexpr, PAGE: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    if slot < 0:  # a padding token owns no cache row
        return
    d = tl.arange(0, BLOCK_D)
    row = tl.load(latent_ptr + i.to(tl.int64) * stride_latent + d, mask=d < D)
    dst = cache_ptr + (slot // PAGE) * stride_blk + (slot % PAGE) * stride_off + d
    tl.store(dst, row.to(cache_ptr.dtype.element_ty), mask=d < D)


@triton.jit(do_not_specialize=["stride_lat_h", "stride_out_s", "stride_lse_s"])  # T * ...: per step
def _split_attention_kernel(
        q_lat_ptr, q_rope_ptr, cache_ptr, block_table_ptr, qsl_ptr, seq_lens_ptr, out_ptr, lse_ptr, skip_ptr, qk_scale,
        stride_lat_t, stride_lat_h, stride_rope_t, stride_rope_h, stride_blk, stride_off, stride_bt,
        stride_out_s, stride_out_t, stride_out_h, stride_lse_s, stride_lse_t,
        H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, FINAL: tl.constexpr,
        HAS_SKIP: tl.constexpr, PRECISION: tl.constexpr):
    # Row blocks vary fastest, so the programs that read the same cache tiles run side by side (L2 reuse).
    mb, split, req = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if HAS_SKIP:
        if tl.load(skip_ptr + req) != 0:  # a prompt chunk the unabsorbed path computes
            return
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    if mb * BLOCK_M >= q_len * H:  # the grid is sized for max_query_len; shorter rows leave blocks idle
        return
    seq_len = tl.load(seq_lens_ptr + req)
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = m < q_len * H
    t, h = m // H, (m % H).to(tl.int64)  # int64 addressing: q_lat's head stride is T * L
    tok = (q_start + t).to(tl.int64)
    last_pos = seq_len - q_len + t  # causal: token t sees cache positions 0..last_pos
    # Split the range the block's last token sees; every split of this block derives the same ranges.
    kv_end = seq_len - q_len + tl.minimum(mb * BLOCK_M + BLOCK_M - 1, q_len * H - 1) // H + 1
    chunk = tl.cdiv(tl.cdiv(kv_end, tl.num_programs(1)), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_end)

    offs_l, offs_r = tl.arange(0, BLOCK_L), tl.arange(0, BLOCK_R)
    l_ok, r_ok = offs_l < L, offs_r < R
    q_lat = tl.load(q_lat_ptr + tok[:, None] * stride_lat_t + h[:, None] * stride_lat_h + offs_l[None, :],
                    mask=row_ok[:, None] & l_ok[None, :], other=0.0).to(cache_ptr.dtype.element_ty)
    q_rope = tl.load(q_rope_ptr + tok[:, None] * stride_rope_t + h[:, None] * stride_rope_h + offs_r[None, :],
                     mask=row_ok[:, None] & r_ok[None, :], other=0.0).to(cache_ptr.dtype.element_ty)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < hi
        page = tl.load(block_table_ptr + req * stride_bt + pos // PAGE, mask=pos_ok, other=0).to(tl.int64)
        row = cache_ptr + page * stride_blk + (pos % PAGE) * stride_off
        c_kv = tl.load(row[:, None] + offs_l[None, :], mask=pos_ok[:, None] & l_ok[None, :], other=0.0)
        k_rope = tl.load(row[:, None] + L + offs_r[None, :], mask=pos_ok[:, None] & r_ok[None, :], other=0.0)
        s = tl.dot(q_lat, tl.trans(c_kv), input_precision=PRECISION)
        s = tl.dot(q_rope, tl.trans(k_rope), s, input_precision=PRECISION)
        s = tl.where(pos_ok[None, :] & (pos[None, :] <= last_pos[:, None]), s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no position yet (causal, in a later split) must stay 0, not exp(-inf + inf).
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(c_kv.dtype), c_kv, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + split.to(tl.int64) * stride_out_s + tok[:, None] * stride_out_t + h[:, None] * stride_out_h
             + offs_l[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & l_ok[None, :])
    if not FINAL:
        # -inf: the split saw nothing for the row (log2 of a guarded l_i, as both branches are evaluated)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + split.to(tl.int64) * stride_lse_s + tok * stride_lse_t + h, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_reqs", "num_splits", "stride_part_s", "stride_lse_s"])
def _merge_splits_kernel(part_ptr, lse_ptr, out_ptr, qsl_ptr, num_reqs, num_splits,
                         stride_part_s, stride_part_t, stride_part_h, stride_lse_s, stride_lse_t,
                         stride_out_t, stride_out_h, L: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr):
    # One program per (token, head, BLOCK_L columns): a lone long request has many splits and few rows, and
    # its merge must not fall to a handful of programs streaming every split's partials one after another.
    tok = tl.program_id(0).to(tl.int64)
    if tok >= tl.load(qsl_ptr + num_reqs):  # padding tokens past the last request have no partials
        return
    h = tl.program_id(1)
    offs_l = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
    l_ok = offs_l < L
    offs_s = tl.arange(0, BLOCK_S)
    lse_row = lse_ptr + tok * stride_lse_t + h
    # The splits' count is a runtime value, so the count each eager step picks needs no kernel of its own.
    # Split 0 always holds position 0, so a real row's max is finite; empty splits carry lse -inf, weigh 0.
    m = float("-inf")
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + offs_s
        m = tl.maximum(m, tl.max(tl.load(lse_row + s.to(tl.int64) * stride_lse_s, mask=s < num_splits,
                                         other=float("-inf"))))
    denom = 0.0
    acc = tl.zeros([BLOCK_L], tl.float32)
    part_row = part_ptr + tok * stride_part_t + h * stride_part_h
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + offs_s
        s_ok = s < num_splits
        w = tl.exp2(tl.load(lse_row + s.to(tl.int64) * stride_lse_s, mask=s_ok, other=float("-inf")) - m)
        part = tl.load(part_row + s.to(tl.int64)[:, None] * stride_part_s + offs_l[None, :],
                       mask=s_ok[:, None] & l_ok[None, :], other=0.0)
        denom += tl.sum(w)
        acc += tl.sum(w[:, None] * part, axis=0)
    tl.store(out_ptr + tok * stride_out_t + h * stride_out_h + offs_l, (acc / denom).to(out_ptr.dtype.element_ty),
             mask=l_ok)


@dataclass(frozen=True, slots=True)
class TileConfig:
    block_m: int  # query rows (token * H + head) per program: the M of both dots
    block_n: int  # cache positions per loop step
    num_warps: int
    num_stages: int


def tile_config(dtype: torch.dtype, rows: int, block_l: int) -> TileConfig:
    """The tile for `rows` = max_query_len * H query rows per request.

    All heads of a decode token share one tile; a request with more rows than BLOCK_M has several row blocks,
    which run side by side so the cache tiles they share come from L2.
    """
    if block_l < 256:  # small latent widths (tests): small tiles, several per context
        return TileConfig(min(64, max(16, triton.next_power_of_2(rows))), 16, 4, 2)
    if dtype == torch.float32:  # ieee fp32 dots run on the FMA units; wider tiles spill
        return TileConfig(16, 16, 8, 2)
    # Measured on the H200 (benchmarks/results/gpu/mla_decode_tuning_*.json): the best of 12 tiles at 16 rows
    # (16 heads x 1 token) and at 64..256 rows (at 1024 rows, 128 heads x 8 tokens, the 32-row tile was 15%
    # faster); no swept shape had 17..32 rows, which take that 32-row tile.
    if rows > 32:
        return TileConfig(64, 64, 8, 2)
    if rows > 16:
        return TileConfig(32, 64, 8, 2)
    return TileConfig(16, 128, 8, 2)


# Split-KV sizing (flash-decoding): enough programs to give every SM PROGRAMS_PER_SM, each split at least
# MIN_SPLIT_LEN positions. Every split writes fp32 partials of rows x L per request that the merge reads back:
# they may take PARTIAL_BUDGET_BYTES (they stay in L2) or PARTIAL_SHARE of the step's roofline time, counted
# in bytes: the cache bytes it reads, or for many rows (compute-bound) its dots' FLOPs over RIDGE_FLOP_PER_BYTE.
PROGRAMS_PER_SM = 1
MIN_SPLIT_LEN = 256
MAX_SPLITS = 128
PARTIAL_BUDGET_BYTES = 24 << 20
PARTIAL_SHARE = 0.25
RIDGE_FLOP_PER_BYTE = 184  # H200: 790 TFLOP/s bf16 measured over 4.3 TB/s copy (../shared/docs/kernels.md)


def auto_num_splits(num_reqs: int, rows_per_req: int, block_m: int, latent_dim: int, max_seq_len: int,
                    cache_row_bytes: int, num_sms: int) -> int:
    """Splits of the context for a step of num_reqs requests of rows_per_req query rows each."""
    programs = num_reqs * -(-rows_per_req // block_m)
    partial_bytes = 2 * num_reqs * rows_per_req * latent_dim * 4  # per split: written, then read
    flops_per_position = 2 * rows_per_req * 2 * latent_dim  # scores and output, both over the latent width
    step_bytes = num_reqs * max_seq_len * max(cache_row_bytes, flops_per_position / RIDGE_FLOP_PER_BYTE)
    budget = max(PARTIAL_BUDGET_BYTES, PARTIAL_SHARE * step_bytes)
    want = min(num_sms * PROGRAMS_PER_SM // programs, -(-max_seq_len // MIN_SPLIT_LEN), MAX_SPLITS,
               int(budget // partial_bytes))
    return max(1, want)


def write_latent(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache[slot] = latent[i] for each token i with slot_mapping[i] >= 0 (flat row = block*bs + offset)."""
    if slot_mapping.shape[0] == 0:
        return
    assert latent.stride(-1) == 1 and kv_cache.stride(-1) == 1
    D = kv_cache.shape[-1]
    _write_latent_kernel[(slot_mapping.shape[0],)](
        latent, kv_cache, slot_mapping, latent.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        D=D, PAGE=kv_cache.shape[1], BLOCK_D=triton.next_power_of_2(D))


def latent_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                     query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                     num_reqs: int, max_query_len: int, max_seq_len: int, scale: float,
                     num_splits: int | None = None, skip_reqs: torch.Tensor | None = None,
                     tile: TileConfig | None = None) -> torch.Tensor:
    """Causal absorbed attention of every query row over its request's paged latent cache.

    q_lat [H, T, L] (W_UK already applied), q_rope [T, H, R], kv_cache [blocks, bs, L+R]. Returns the
    latent output [T, H, L] in q_lat's dtype; rows of tokens outside every request, and of requests whose
    skip_reqs entry (device int8 [num_reqs]) is non-zero, are left unwritten (with num_splits == 1 only:
    the merge would read their partials). max_query_len and max_seq_len bound the rows' lengths (they size
    the grid); num_splits None picks the split count from them (auto_num_splits); tile overrides tile_config.
    """
    assert skip_reqs is None or num_splits in (None, 1), "skipped requests have no partials to merge"
    H, T, L = q_lat.shape
    R = q_rope.shape[-1]
    assert q_lat.stride(-1) == 1 and q_rope.stride(-1) == 1 and kv_cache.stride(-1) == 1
    out = q_lat.new_empty(T, H, L)
    if T == 0 or num_reqs == 0:
        return out
    BLOCK_L, BLOCK_R = triton.next_power_of_2(L), max(16, triton.next_power_of_2(R))
    tile = tile or tile_config(kv_cache.dtype, max_query_len * H, BLOCK_L)
    if num_splits is None:
        num_splits = 1 if skip_reqs is not None else auto_num_splits(
            num_reqs, max_query_len * H, tile.block_m, L, max_seq_len, kv_cache.shape[-1] * kv_cache.element_size(),
            num_sms(q_lat.device))
    final = num_splits == 1  # a single split is already normalised: write it straight out, skip the merge
    if final:
        part, lse = out.unsqueeze(0), out.new_empty(0, 0, dtype=torch.float32)  # lse is not written
    else:
        part = torch.empty(num_splits, T, H, L, dtype=torch.float32, device=q_lat.device)
        lse = torch.empty(num_splits, T, H, dtype=torch.float32, device=q_lat.device)
    grid = (triton.cdiv(max_query_len * H, tile.block_m), num_splits, num_reqs)
    _split_attention_kernel[grid](
        q_lat, q_rope, kv_cache, block_table, query_start_loc, seq_lens, part, lse,
        query_start_loc if skip_reqs is None else skip_reqs, scale * math.log2(math.e),
        q_lat.stride(1), q_lat.stride(0), q_rope.stride(0), q_rope.stride(1), kv_cache.stride(0),
        kv_cache.stride(1), block_table.stride(0), part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1),
        H=H, L=L, R=R, PAGE=kv_cache.shape[1], BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_L=BLOCK_L,
        BLOCK_R=BLOCK_R, FINAL=final, HAS_SKIP=skip_reqs is not None,
        PRECISION="ieee" if kv_cache.dtype == torch.float32 else "tf32",
        num_warps=tile.num_warps, num_stages=tile.num_stages)
    if not final:
        block_l = min(128, BLOCK_L)
        _merge_splits_kernel[(T, H, triton.cdiv(L, block_l))](
            part, lse, out, query_start_loc, num_reqs, num_splits, part.stride(0), part.stride(1), part.stride(2),
            lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), L=L, BLOCK_S=16, BLOCK_L=block_l,
            num_warps=4)
    return out
