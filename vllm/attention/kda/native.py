"""Fused KDA decode in Triton: conv-state update, gate, delta-rule recurrence and gated RMSNorm in one launch.

Decode is bound by the recurrent state: every request reads and writes an H x [V, K] state per layer and does
little arithmetic per byte. The kernel is shaped around moving those bytes once and keeping the SMs full:

* One program per (request, head) owns that head's state for all of the row's tokens: it reads the state once
  per row and writes it once per row (once per token only where checkpoint columns ask for every token's
  state), with loads and stores coalesced along K, the contiguous dim.
* Rows of S are independent given the per-token head vectors (q, k, decay, beta), so the program computes those
  once and then streams the state through registers in blocks of BV rows, running every token on a block before
  moving to the next. A [BV, K] block instead of the whole [V, K] tile keeps registers low enough for several
  programs per SM, whose loads overlap each other's arithmetic.
* Not splitting a head across programs is what makes the in-place updates race-free: the q/k conv state of a
  head feeds every V row, so with V split across programs one could overwrite it before another had read it.
  Within a program, barriers order each state's loads before its in-place stores, whichever threads they land
  on. The gated RMSNorm needs all V rows of o: the unnormalised o is parked in `out` until the last block.
* The token loops are unrolled to max_query_len (a compile-time constant: 1 for plain decode, 1 + num_spec with
  speculative decoding, so only a few variants get compiled); the real ragged lengths come from the device
  offsets, so the launch is CUDA-graph safe: no host syncs, grid (N, H) from shapes only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.attention.backend import AttentionCGSupport, LayerShapes
from vllm.attention.kda import ops
from vllm.attention.kda.metadata import KDABackend, KDARows, KDAWeights

# Kernels may read only constexpr globals.
SOFTPLUS_LINEAR_ABOVE = tl.constexpr(ops.SOFTPLUS_LINEAR_ABOVE)
L2NORM_EPS = tl.constexpr(1e-6)  # ops.l2norm's default
# State rows per block, run by BV * K / 16 threads: at 16 state elements per thread the compiler keeps the block
# in its coalesced load layout (at 32 it reshuffles it through shared memory), and plain decode at K = 128 needs
# 64-73 registers (ptxas, sm_90), i.e. 3-4 programs of 8 warps per SM.
BLOCK_V = 32


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
    conv_state_ptr, ssm_ptr, qsl_ptr, idx_ptr, nacc_ptr,
    stride_qkv, stride_gate, stride_beta, stride_ogate, stride_out, stride_cw,
    stride_cs_slot, stride_cs_c, stride_cs_w, stride_ssm_slot, stride_idx,
    norm_eps, lower_bound, q_scale,
    P: tl.constexpr, K: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, MAX_T: tl.constexpr,
    BV: tl.constexpr, BOUNDED: tl.constexpr, SPEC: tl.constexpr, PREFETCH: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(qsl_ptr + r).to(tl.int64)
    length = tl.load(qsl_ptr + r + 1) - start
    if SPEC:  # checkpoint columns: start from the last accepted token's state
        src = tl.load(idx_ptr + r * stride_idx + tl.load(nacc_ptr + r) - 1).to(tl.int64)
    else:
        src = tl.load(idx_ptr + r).to(tl.int64)
    if (length <= 0) | (src < 0):  # padding row or padding slot
        return
    act = qkv_ptr.dtype.element_ty
    src_conv = conv_state_ptr + src * stride_cs_slot
    offs = tl.arange(0, K)
    jw = tl.arange(0, BW)[None, :]
    ch = h * K + offs  # this head's channels within q, k, gate and output

    # Per-token head vectors, computed once for all V-blocks. Tokens past the row's end (t >= length) run on
    # masked zeros and store nothing.
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
        # after every token to that token's checkpoint column.
        if SPEC:
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
    # States go back in place, possibly stored by other threads of this program than the ones that loaded
    # them (the compiler picks each op's thread mapping): a barrier puts every load before every store.
    tl.debug_barrier()
    for t in tl.static_range(MAX_T):
        dst_conv = conv_state_ptr + dsts[t] * stride_cs_slot
        _store_conv_state(dst_conv, stride_cs_c, stride_cs_w, ch, wins_q[t], saves[t], W, BW)
        _store_conv_state(dst_conv, stride_cs_c, stride_cs_w, P + ch, wins_k[t], saves[t], W, BW)

    # The recurrence, BV rows of the state at a time: rows are independent given the head vectors above, so
    # registers hold a [BV, K] block and several programs fit on an SM.
    # With PREFETCH the next block's state load is issued before this block's math, so every program keeps
    # two blocks of loads in flight: decode is latency-bound on those loads, not on the arithmetic.
    NB: tl.constexpr = K // BV
    block = tl.arange(0, BV)
    state_base = ssm_ptr + src * stride_ssm_slot + h * K * K
    if PREFETCH:
        S_next = tl.load(state_base + block[:, None] * K + offs[None, :])
    for b in tl.static_range(NB):
        rows = b * BV + block
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
        tl.debug_barrier()  # this block's v conv state is stored in place below
        for t in tl.static_range(MAX_T):
            tok = start + t
            v = _conv_silu(wins_v[t], w_v, act)
            S = S * decays[t][None, :]
            c = betas[t] * (v - tl.sum(S * ks[t][None, :], axis=1))
            S = S + c[:, None] * ks[t][None, :]
            o = tl.sum(S * qs[t][None, :], axis=1)
            # The gated RMSNorm needs all V rows: park o in `out` (rounded to the activation dtype, as the
            # reference normalises it) until every block is done.
            tl.store(out_ptr + tok * stride_out + h * K + rows, o.to(out_ptr.dtype.element_ty), mask=t < length)
            tl.store(ssm_ptr + dsts[t] * stride_ssm_slot + state_offs, S.to(ssm_ptr.dtype.element_ty),
                     mask=saves[t])
            _store_conv_state(conv_state_ptr + dsts[t] * stride_cs_slot, stride_cs_c, stride_cs_w, ch_v,
                              wins_v[t], saves[t], W, BW)

    tl.debug_barrier()  # every thread sees every block's parked o
    norm_w = tl.load(norm_w_ptr + offs).to(tl.float32)
    for t in tl.static_range(MAX_T):
        tok = start + t
        valid = t < length
        o = tl.load(out_ptr + tok * stride_out + ch, mask=valid, other=0.0).to(tl.float32)
        o = o * tl.rsqrt(tl.sum(o * o) / K + norm_eps) * norm_w
        o = o * tl.sigmoid(tl.load(ogate_ptr + tok * stride_ogate + ch, mask=valid, other=0.0).to(tl.float32))
        tl.store(out_ptr + tok * stride_out + ch, o.to(out_ptr.dtype.element_ty), mask=valid)


def fused_kda_decode(mixed_qkv: torch.Tensor, raw_gate: torch.Tensor, raw_beta: torch.Tensor,
                     output_gate: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
                     dt_bias: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float, lower_bound: float | None,
                     conv_state: torch.Tensor, ssm_state: torch.Tensor, query_start_loc: torch.Tensor,
                     state_indices: torch.Tensor, num_accepted_tokens: torch.Tensor | None = None, *,
                     num_heads: int, head_dim: int, max_query_len: int, out: torch.Tensor | None = None,
                     block_v: int = BLOCK_V, prefetch: bool | None = None, num_warps: int | None = None
                     ) -> torch.Tensor:
    """KDA over decode rows of 1..max_query_len tokens; returns the gated-normalised output [T, H*K].

    mixed_qkv [T, 3P] (pre-conv), raw_gate [T, P], raw_beta [T, H], output_gate [T, P], conv_weight [3P, W],
    A_log [H], dt_bias [P], norm_weight [K]. conv_state [slots, 3P, W-1] and ssm_state [slots, H, V, K]
    (float32 or bfloat16) are updated in place. Request r owns tokens query_start_loc[r]:query_start_loc[r+1].
    state_indices [N] gives each request's slot; [N, C] gives checkpoint columns: the state is read from column
    num_accepted_tokens[r] - 1 and the state after token t written to column t. Rows with no tokens or a
    negative slot are skipped, and their output rows left as they are (uninitialised when `out` is None);
    `out`, if given, is [T, P] in the activation dtype. block_v, prefetch and num_warps are tuning knobs
    (benchmarks/kernels/tune_kda_native.py); the defaults are the ones measured best on the H200.
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
    if out is None:
        out = mixed_qkv.new_empty(T, P)
    for x in (mixed_qkv, raw_gate, raw_beta, output_gate, out, conv_weight, A_log, dt_bias, norm_weight):
        assert x.stride(-1) == 1, "channels must be contiguous"
    if N == 0 or T == 0:
        return out
    BV = min(K, block_v)
    if prefetch is None:
        # Measured on the H200 at batch 64 (benchmarks/results/gpu/kda_native_tuning.json): prefetching the next
        # block helps bf16 state (3%) and costs fp32 state (16%), whose blocks already fill the memory pipes.
        prefetch = ssm_state.dtype == torch.bfloat16
    _fused_kda_decode_kernel[(N, H)](
        mixed_qkv, raw_gate, raw_beta, output_gate, out,
        conv_weight, A_log, dt_bias, norm_weight,
        conv_state, ssm_state, query_start_loc, state_indices,
        num_accepted_tokens if spec else state_indices,
        mixed_qkv.stride(0), raw_gate.stride(0), raw_beta.stride(0), output_gate.stride(0), out.stride(0),
        conv_weight.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        ssm_state.stride(0), state_indices.stride(0),
        norm_eps, 0.0 if lower_bound is None else lower_bound, K ** -0.5,
        P=P, K=K, W=W, BW=triton.next_power_of_2(W), MAX_T=max_query_len, BV=BV,
        BOUNDED=lower_bound is not None, SPEC=spec, PREFETCH=prefetch and K > BV,
        num_warps=num_warps or max(1, BV * K // (32 * 16)),  # 16 state elements per thread: see BLOCK_V
    )
    return out


class NativeKDABackend(KDABackend):
    """`--kda-decode-backend native`: the fused kernel above, for decode rows of 1..max_query_len tokens."""
    name = "native"
    runs_decode = True
    decode_checkpoints = True
    decode_reads_device_offsets = True
    # Row lengths come from the device offsets and the grid from (N, H): any decode batch replays.
    decode_cudagraph_support = AttentionCGSupport.ALWAYS

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
                       ssm_state: torch.Tensor, rows: KDARows) -> torch.Tensor:
        T = rows.num_tokens
        return fused_kda_decode(
            mixed_qkv[:T], raw_gate[:T], raw_beta[:T], output_gate[:T], layer.conv_weight, layer.A_log,
            layer.dt_bias, layer.o_norm.weight, layer.o_norm.eps, layer.gate_lower_bound, conv_state, ssm_state,
            rows.query_start_loc, rows.state_indices, rows.num_accepted_tokens, num_heads=layer.num_heads,
            head_dim=layer.head_dim, max_query_len=rows.max_query_len)
