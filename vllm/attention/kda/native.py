"""Fused KDA decode in Triton: conv-state update, gate, delta-rule recurrence and gated RMSNorm in one launch.

Decode is bound by the recurrent state: every request reads and writes an H x [V, K] state per layer and does
little arithmetic per byte. The kernel is shaped around moving those bytes once and keeping the SMs busy:

* Rows of S are independent given the per-token head vectors (q, k, decay, beta). A program owns K / SPLIT
  rows of one (request, head): it computes the head vectors once, then streams its rows through registers in
  blocks of BV, running every token of the row on a block before moving to the next, with loads and stores
  coalesced along K. A [BV, K] block instead of the whole tile keeps registers low enough for several
  programs per SM; with PREFETCH the next block's load is issued before this block's math.
* SPLIT > 1 is for small batches, where (request, head) programs alone leave most SMs idle (batch 1): the
  head's rows are spread over SPLIT programs. What they share is then finished by the last of them to
  arrive: the q/k conv state (every part reads it, so none may overwrite it before the others have) and the
  gated RMSNorm (it needs all V rows of o, which the parts park unnormalised in `out`). Each part bumps an
  arrival counter of its (request, head) after its stores, behind a barrier, with release/acquire semantics;
  the one that sees SPLIT - 1 earlier arrivals runs the epilogue and resets the counter, so the counters are
  all zero between launches, as a CUDA graph replay needs. With SPLIT = 1 the program runs it directly.
* Each program's own v conv channels and state rows are written only by it: barriers put each state's
  loads before its in-place stores, whichever threads they land on.
* The token loops are unrolled to max_query_len (a compile-time constant: 1 for plain decode, 1 + num_spec with
  speculative decoding, so only a few variants get compiled); the real ragged lengths come from the device
  offsets, so the launch is CUDA-graph safe: no host syncs, grid (N, H, SPLIT) from shapes only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.attention.backend import AttentionCGSupport, LayerShapes
from vllm.attention.kda import ops
from vllm.attention.kda.metadata import KDABackend, KDARows, KDAWeights
from vllm.attention.kda.recover import KDARecords
from vllm.utils import num_sms

# Kernels may read only constexpr globals.
SOFTPLUS_LINEAR_ABOVE = tl.constexpr(ops.SOFTPLUS_LINEAR_ABOVE)
L2NORM_EPS = tl.constexpr(1e-6)  # ops.l2norm's default
# Schedule defaults (benchmarks/kernels/tune_kda_native.py, kda_decode_ab_3d85fdf.json): state rows per block;
# warps at 16 state elements per thread (at that density the compiler keeps a block in its coalesced load
# layout); a head's rows split over up to MAX_SPLIT programs while the batch has fewer (request, head)
# programs than the GPU has SMs: at batch 1 that is 1.3x faster, at 8 x 32 heads a split is 1.3x slower.
BLOCK_V = 32
ELEMENTS_PER_THREAD = 16
MAX_SPLIT = 4


@triton.jit
def _conv_window(qkv_ptr, stride_qkv, start, length, t, cs_ptr, stride_c, stride_w, ch,
                 W: tl.constexpr, BW: tl.constexpr):
    """[C, BW] conv window of token t over channels `ch`: column j holds input t - (W-1) + j of the row, taken
    from the conv state where that is before the row; columns past W - 1 are zero."""
    j = tl.arange(0, BW)[None, :]
    pos = t - (W - 1) + j
    x = tl.load(qkv_ptr + (start + pos) * stride_qkv + ch[:, None], mask=(pos >= 0) & (pos < length) & (j < W),
                other=0.0)
    earlier = tl.load(cs_ptr + ch[:, None] * stride_c + (t + j) * stride_w, mask=pos < 0, other=0.0)
    return tl.where(pos < 0, earlier, x).to(tl.float32)


@triton.jit
def _conv_silu(window, w, act: tl.constexpr):
    """SiLU of the depthwise conv, rounded to the activation dtype as the reference stores activations."""
    y = tl.sum(window * w, axis=1)
    return (y * tl.sigmoid(y)).to(act).to(tl.float32)


@triton.jit
def _store_conv_state(cs_ptr, stride_c, stride_w, ch, window, save, W: tl.constexpr, BW: tl.constexpr):
    """The conv state after a token is its window's last W - 1 inputs: column j goes to state column j - 1."""
    j = tl.arange(0, BW)[None, :]
    tl.store(cs_ptr + ch[:, None] * stride_c + (j - 1) * stride_w, window.to(cs_ptr.dtype.element_ty),
             mask=(j >= 1) & (j < W) & save)


@triton.jit
def _fused_kda_decode_kernel(
    qkv_ptr, gate_ptr, beta_ptr, ogate_ptr, out_ptr,
    conv_w_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr,
    conv_state_ptr, ssm_ptr, qsl_ptr, idx_ptr, nacc_ptr, arrivals_ptr, rec_c_ptr, rec_kd_ptr, rec_x_ptr,
    stride_qkv, stride_gate, stride_beta, stride_ogate, stride_out, stride_cw,
    stride_cs_slot, stride_cs_c, stride_cs_w, stride_ssm_slot, stride_idx, stride_rc, stride_rkd, stride_rx,
    norm_eps, lower_bound, q_scale,
    H: tl.constexpr, P: tl.constexpr, K: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, MAX_T: tl.constexpr,
    SPLIT: tl.constexpr, BV: tl.constexpr, PREFETCH: tl.constexpr, BOUNDED: tl.constexpr, SPEC: tl.constexpr,
    RECORD: tl.constexpr, Q: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    part = tl.program_id(2)  # which K / SPLIT state rows of the head this program owns
    start = tl.load(qsl_ptr + r).to(tl.int64)
    length = tl.load(qsl_ptr + r + 1) - start
    if SPEC:  # checkpoint columns: start from the last accepted token's state
        src = tl.load(idx_ptr + r * stride_idx + tl.load(nacc_ptr + r) - 1).to(tl.int64)
    else:
        src = tl.load(idx_ptr + r).to(tl.int64)
    if (length <= 0) | (src < 0):  # padding row or padding slot: no program of it counts an arrival
        return
    act = qkv_ptr.dtype.element_ty
    offs = tl.arange(0, K)
    NB: tl.constexpr = K // SPLIT // BV  # blocks of BV rows per program
    first_row = part * (K // SPLIT)
    state_base = ssm_ptr + src * stride_ssm_slot + h * K * K
    block = tl.arange(0, BV)
    if PREFETCH and SPLIT > 1:  # a split program has few blocks: the first one's load goes out right away
        S_next = tl.load(state_base + (first_row + block)[:, None] * K + offs[None, :])

    src_conv = conv_state_ptr + src * stride_cs_slot
    jw = tl.arange(0, BW)[None, :]
    ch = h * K + offs  # this head's channels within q, k, gate and output
    # Per-token head vectors. Tokens past the row's end (t >= length) run on masked zeros and store nothing.
    a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + ch).to(tl.float32)
    w_q = tl.load(conv_w_ptr + ch[:, None] * stride_cw + jw, mask=jw < W, other=0.0).to(tl.float32)
    w_k = tl.load(conv_w_ptr + (P + ch[:, None]) * stride_cw + jw, mask=jw < W, other=0.0).to(tl.float32)
    qs, ks, decays, betas, wins_q, wins_k, dsts, saves = (), (), (), (), (), (), (), ()
    for t in tl.static_range(MAX_T):
        tok = start + t
        valid = t < length
        win_q = _conv_window(qkv_ptr, stride_qkv, start, length, t, src_conv, stride_cs_c, stride_cs_w, ch, W, BW)
        win_k = _conv_window(qkv_ptr, stride_qkv, start, length, t, src_conv, stride_cs_c, stride_cs_w, P + ch,
                             W, BW)
        q = _conv_silu(win_q, w_q, act)
        k = _conv_silu(win_k, w_k, act)
        s = tl.load(gate_ptr + tok * stride_gate + ch, mask=valid, other=0.0).to(tl.float32) + dt_bias
        if BOUNDED:
            g = lower_bound * tl.sigmoid(a * s)
        else:  # -a * softplus(s), in the overflow-free form
            softplus = tl.maximum(s, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(s)))
            g = -a * tl.where(s > SOFTPLUS_LINEAR_ABOVE, s, softplus)
        # Plain decode writes the final state back to the source slot; speculative decoding writes the state
        # after every token to that token's checkpoint column; RecoverSSM writes no state, only records.
        if RECORD:
            dst = src
            save = length < 0
        elif SPEC:
            dst = tl.load(idx_ptr + r * stride_idx + t, mask=valid, other=-1).to(tl.int64)
            save = dst >= 0
        else:
            dst = src
            save = t == length - 1
        qs += (q * tl.rsqrt(tl.sum(q * q) + L2NORM_EPS) * q_scale,)
        ks += (k * tl.rsqrt(tl.sum(k * k) + L2NORM_EPS),)
        decays += (tl.exp(g),)
        betas += (tl.sigmoid(tl.load(beta_ptr + tok * stride_beta + h, mask=valid, other=0.0).to(tl.float32)),)
        wins_q += (win_q,)
        wins_k += (win_k,)
        dsts += (dst,)
        saves += (save,)
        if RECORD:  # the key and decay the recurrence below uses, and the q/k conv inputs, by one part per head
            kd = rec_kd_ptr + src * stride_rkd + (h * Q + t) * 2 * K + offs
            first_part = valid & (part == 0)
            tl.store(kd, ks[t], mask=first_part)
            tl.store(kd + K, decays[t], mask=first_part)
            x_rec = rec_x_ptr + src * stride_rx + t * 3 * P
            for qk in tl.static_range(2):
                tl.store(x_rec + qk * P + ch, tl.load(qkv_ptr + tok * stride_qkv + qk * P + ch, mask=valid),
                         mask=first_part)
    if SPLIT == 1:  # the only reader of the head's q/k conv state is done with it: write it back now
        tl.debug_barrier()
        for t in tl.static_range(MAX_T):
            dst_conv = conv_state_ptr + dsts[t] * stride_cs_slot
            _store_conv_state(dst_conv, stride_cs_c, stride_cs_w, ch, wins_q[t], saves[t], W, BW)
            _store_conv_state(dst_conv, stride_cs_c, stride_cs_w, P + ch, wins_k[t], saves[t], W, BW)
        if PREFETCH:  # with the next block's load issued a block ahead from here on
            S_next = tl.load(state_base + (first_row + block)[:, None] * K + offs[None, :])

    for b in tl.static_range(NB):
        rows = first_row + b * BV + block
        state_offs = h * K * K + rows[:, None] * K + offs[None, :]  # K contiguous
        if PREFETCH:
            S = S_next.to(tl.float32)
            if b + 1 < NB:
                S_next = tl.load(state_base + (rows + BV)[:, None] * K + offs[None, :])
        else:
            S = tl.load(state_base + rows[:, None] * K + offs[None, :]).to(tl.float32)
        ch_v = 2 * P + h * K + rows  # this block's v channels
        w_v = tl.load(conv_w_ptr + ch_v[:, None] * stride_cw + jw, mask=jw < W, other=0.0).to(tl.float32)
        wins_v = ()
        for t in tl.static_range(MAX_T):
            wins_v += (_conv_window(qkv_ptr, stride_qkv, start, length, t, src_conv, stride_cs_c, stride_cs_w,
                                    ch_v, W, BW),)
        tl.debug_barrier()  # this block's v conv state and state rows are stored in place below
        for t in tl.static_range(MAX_T):
            tok = start + t
            v = _conv_silu(wins_v[t], w_v, act)
            S = S * decays[t][None, :]
            c = betas[t] * (v - tl.sum(S * ks[t][None, :], axis=1))
            # An explicit FMA, as RecoverSSM's commit does it: the compiler may not contract it another way.
            S = tl.fma(c[:, None], ks[t][None, :], S)
            if RECORD:
                tl.store(rec_c_ptr + src * stride_rc + (h * Q + t) * K + rows, c, mask=t < length)
                tl.store(rec_x_ptr + src * stride_rx + t * 3 * P + ch_v,
                         tl.load(qkv_ptr + tok * stride_qkv + ch_v, mask=t < length), mask=t < length)
            o = tl.sum(S * qs[t][None, :], axis=1)
            # The gated RMSNorm needs all V rows: park o in `out` (rounded to the activation dtype, as the
            # reference normalises it) for the epilogue.
            tl.store(out_ptr + tok * stride_out + h * K + rows, o.to(out_ptr.dtype.element_ty), mask=t < length)
            tl.store(ssm_ptr + dsts[t] * stride_ssm_slot + state_offs, S.to(ssm_ptr.dtype.element_ty),
                     mask=saves[t])
            _store_conv_state(conv_state_ptr + dsts[t] * stride_cs_slot, stride_cs_c, stride_cs_w, ch_v,
                              wins_v[t], saves[t], W, BW)

    # The epilogue (gated RMSNorm; with SPLIT > 1 the q/k conv state too) runs once per head, after every part
    # of it: the barrier puts all of this program's stores first; with SPLIT > 1 the last part to bump the
    # arrival counter runs it (the bump releases this program's stores, the last one's acquires the others').
    tl.debug_barrier()
    last = True
    if SPLIT > 1:
        counter = arrivals_ptr + r * H + h
        last = tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT - 1
    if last:
        if SPLIT > 1:
            tl.debug_barrier()
            for t in tl.static_range(MAX_T):
                dst_conv = conv_state_ptr + dsts[t] * stride_cs_slot
                _store_conv_state(dst_conv, stride_cs_c, stride_cs_w, ch, wins_q[t], saves[t], W, BW)
                _store_conv_state(dst_conv, stride_cs_c, stride_cs_w, P + ch, wins_k[t], saves[t], W, BW)
        norm_w = tl.load(norm_w_ptr + offs).to(tl.float32)
        for t in tl.static_range(MAX_T):
            tok = start + t
            valid = t < length
            y = tl.load(out_ptr + tok * stride_out + ch, mask=valid, other=0.0).to(tl.float32)
            y = y * tl.rsqrt(tl.sum(y * y) / K + norm_eps) * norm_w
            y = y * tl.sigmoid(tl.load(ogate_ptr + tok * stride_ogate + ch, mask=valid, other=0.0).to(tl.float32))
            tl.store(out_ptr + tok * stride_out + ch, y.to(out_ptr.dtype.element_ty), mask=valid)
        if SPLIT > 1:
            tl.store(arrivals_ptr + r * H + h, 0)  # the next launch is stream-ordered after this one


_ARRIVALS: dict[torch.device, torch.Tensor] = {}
_MIN_ARRIVALS = 1 << 16  # 256 KiB: 512 requests x 128 heads without ever growing


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """The zeroed int32 arrival counters of a device, at least n of them. They are shared by every layer and
    launch (each launch leaves them zero) and grow only outside graph capture: a captured launch must keep
    the buffer it was captured with."""
    have = _ARRIVALS.get(device)
    if have is None or have.numel() < n:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"KDA decode needs {n} arrival counters but has {0 if have is None else have.numel()}"
                               "; run the batch eagerly once before capturing it")
        _ARRIVALS[device] = have = torch.zeros(max(n, _MIN_ARRIVALS), dtype=torch.int32, device=device)
    return have


def fused_kda_decode(mixed_qkv: torch.Tensor, raw_gate: torch.Tensor, raw_beta: torch.Tensor,
                     output_gate: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
                     dt_bias: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float, lower_bound: float | None,
                     conv_state: torch.Tensor, ssm_state: torch.Tensor, query_start_loc: torch.Tensor,
                     state_indices: torch.Tensor, num_accepted_tokens: torch.Tensor | None = None, *,
                     num_heads: int, head_dim: int, max_query_len: int, out: torch.Tensor | None = None,
                     split: int | None = None, block_v: int = BLOCK_V, prefetch: bool | None = None,
                     num_warps: int | None = None, records: KDARecords | None = None) -> torch.Tensor:
    """KDA over decode rows of 1..max_query_len tokens; returns the gated-normalised output [T, H*K].

    mixed_qkv [T, 3P] (pre-conv), raw_gate [T, P], raw_beta [T, H], output_gate [T, P], conv_weight [3P, W],
    A_log [H], dt_bias [P], norm_weight [K]. conv_state [slots, 3P, W-1] and ssm_state [slots, H, V, K]
    (float32 or bfloat16) are updated in place. Request r owns tokens query_start_loc[r]:query_start_loc[r+1].
    state_indices [N] gives each request's slot; [N, C] gives checkpoint columns: the state is read from column
    num_accepted_tokens[r] - 1 and the state after token t written to column t. Rows with no tokens or a
    negative slot are skipped, and their output rows left as they are (uninitialised when `out` is None);
    `out`, if given, is [T, P] in the activation dtype. With `records` (RecoverSSM, 1-D state_indices, rows of at
    most records.record_len tokens) the pools are only read: each token's correction, key, decay and input go to
    the slot's records instead (recover.py). split (programs per head), block_v (state rows per
    block), prefetch and num_warps are tuning knobs (benchmarks/kernels/tune_kda_native.py); the defaults are the ones
    measured best on the H200.
    """
    H, K = num_heads, head_dim
    P, W = H * K, conv_weight.shape[-1]
    T, N = mixed_qkv.shape[0], state_indices.shape[0]
    assert K & (K - 1) == 0, "head_dim must be a power of two (tiles are unmasked)"
    assert mixed_qkv.shape[-1] == 3 * P and conv_state.shape[1:] == (3 * P, W - 1)
    assert ssm_state.shape[1:] == (H, K, K) and ssm_state[0].is_contiguous()
    assert out is None or out.dtype == mixed_qkv.dtype, "o is parked in `out`, rounded to the activation dtype"
    spec = state_indices.dim() == 2
    if spec:
        assert num_accepted_tokens is not None and state_indices.shape[1] >= max_query_len
    if records is not None:
        assert not spec and max_query_len <= records.record_len, "records take 1-D slots and rows of <= Q tokens"
        assert records.x.shape[-1] == 3 * P and records.c[0].is_contiguous() and records.kd[0].is_contiguous()
    if out is None:
        out = mixed_qkv.new_empty(T, P)
    for x in (mixed_qkv, raw_gate, raw_beta, output_gate, out, conv_weight, A_log, dt_bias, norm_weight):
        assert x.stride(-1) == 1, "channels must be contiguous"
    if N == 0 or T == 0:
        return out
    BV = min(K, block_v)
    if split is None:
        split = programs_per_head(N, H, K, BV, num_sms(mixed_qkv.device))
    assert K % (split * BV) == 0, f"{K} state rows do not split into {split} programs of {BV}-row blocks"
    if prefetch is None:
        # Measured at batch 64 (kda_native_tuning_7a97685.json): prefetching the next block costs 12-18% with
        # either state dtype; a split program's first block goes out early instead.
        prefetch = split > 1
    _fused_kda_decode_kernel[(N, H, split)](
        mixed_qkv, raw_gate, raw_beta, output_gate, out,
        conv_weight, A_log, dt_bias, norm_weight,
        conv_state, ssm_state, query_start_loc, state_indices,
        num_accepted_tokens if spec else state_indices,
        arrival_counters(mixed_qkv.device, N * H) if split > 1 else state_indices,
        *((records.c, records.kd, records.x) if records is not None else (ssm_state,) * 3),
        mixed_qkv.stride(0), raw_gate.stride(0), raw_beta.stride(0), output_gate.stride(0), out.stride(0),
        conv_weight.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        ssm_state.stride(0), state_indices.stride(0),
        *((records.c.stride(0), records.kd.stride(0), records.x.stride(0)) if records is not None else (0, 0, 0)),
        norm_eps, 0.0 if lower_bound is None else lower_bound, K ** -0.5,
        H=H, P=P, K=K, W=W, BW=triton.next_power_of_2(W), MAX_T=max_query_len, SPLIT=split, BV=BV, PREFETCH=prefetch,
        BOUNDED=lower_bound is not None, SPEC=spec, RECORD=records is not None,
        Q=records.record_len if records is not None else 1,
        num_warps=num_warps or max(1, BV * K // (32 * ELEMENTS_PER_THREAD)),
    )
    return out


def programs_per_head(num_rows: int, num_heads: int, head_dim: int, block_v: int, num_sms: int) -> int:
    """The default split: doubled (up to MAX_SPLIT, while each part keeps a whole block) for as long as the
    (request, head) programs of the batch leave SMs without one."""
    split = 1
    while split < MAX_SPLIT and head_dim // (2 * split) >= block_v and num_rows * num_heads * split < num_sms:
        split *= 2
    return split


class NativeKDABackend(KDABackend):
    """`--kda-decode-backend native`: the fused kernel above, for decode rows of 1..max_query_len tokens."""
    name = "native"
    runs_decode = True
    decode_checkpoints = True
    decode_records = True
    decode_reads_device_offsets = True
    # Row lengths come from the device offsets and the grid from (N, H): any decode batch replays.
    decode_cudagraph_support = AttentionCGSupport.VARLEN_DECODE

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, shapes: LayerShapes | None = None) -> str | None:
        if device.type != "cuda":
            return f"the native Triton kernel needs a CUDA GPU (device is {device})"
        if shapes is not None and shapes.kda_head_dim and shapes.kda_head_dim & (shapes.kda_head_dim - 1):
            return f"needs a power-of-two KDA head_dim (model has {shapes.kda_head_dim})"
        return None

    @classmethod
    def forward_decode(cls, layer: KDAWeights, mixed_qkv: torch.Tensor, raw_gate: torch.Tensor,
                       raw_beta: torch.Tensor, output_gate: torch.Tensor, conv_state: torch.Tensor,
                       ssm_state: torch.Tensor, rows: KDARows, records: KDARecords | None = None) -> torch.Tensor:
        T = rows.num_tokens
        return fused_kda_decode(
            mixed_qkv[:T], raw_gate[:T], raw_beta[:T], output_gate[:T], layer.conv_weight, layer.A_log,
            layer.dt_bias, layer.o_norm.weight, layer.o_norm.eps, layer.gate_lower_bound, conv_state, ssm_state,
            rows.query_start_loc, rows.state_indices, rows.num_accepted_tokens, num_heads=layer.num_heads,
            head_dim=layer.head_dim, max_query_len=rows.max_query_len, records=records if rows.record else None)
