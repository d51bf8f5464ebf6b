"""Fused KDA decode in Triton: conv-state update, gate, delta-rule recurrence and gated RMSNorm in one launch.

Decode is bound by the recurrent state: every request reads and writes H x [V, K] state per layer while it
computes only a few vectors per token. The kernel is shaped around moving those bytes once:

* One program per (request, head) holds the head's whole [V, K] state tile in fp32 registers for all of the
  row's tokens, so the state is read once and written once per row (not per token), with loads and stores
  coalesced along K, the contiguous dim. The per-head vectors (conv weights, dt_bias, norm weight, exp(A_log))
  are loaded once per program, and q, k, g, beta once per token, never per V-row.
* Not splitting V is also what makes the in-place conv-state update safe: the q/k conv channels of a head are
  read by whoever computes that head, so with V split across programs one program could overwrite them before
  another had read them. Here each program alone reads and writes its head's q, k and v conv channels of its
  request's slots (requests never share a slot).
* The per-token loop has a compile-time trip count (max_query_len: 1 for plain decode, 1 + num_spec with
  speculative decoding, so only a few variants get compiled); the real ragged lengths come from the device
  offsets, so the launch is CUDA-graph safe: no host syncs, grid (N, H) from shapes only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.attention.backend import AttentionCGSupport, LayerShapes
from vllm.attention.kda.metadata import KDABackend, KDARows, KDAWeights

from vllm.attention.kda import ops

# Kernels may read only constexpr globals.
SOFTPLUS_LINEAR_ABOVE = tl.constexpr(ops.SOFTPLUS_LINEAR_ABOVE)
L2NORM_EPS = tl.constexpr(1e-6)  # ops.l2norm's default


@triton.jit
def _load_conv_state(cs_ptr, ch, stride_c, stride_w, W: tl.constexpr):
    """The conv state of channels `ch` (the W - 1 inputs before the row) as a tuple of [K] vectors."""
    cols = ()
    for i in tl.static_range(W - 1):
        cols = cols + (tl.load(cs_ptr + ch * stride_c + i * stride_w).to(tl.float32),)
    return cols


@triton.jit
def _conv_silu(qkv_ptr, stride_qkv, start, t, ch, hist, w_ptr, stride_w, W: tl.constexpr):
    """Token t's depthwise causal conv over channels `ch`: its W window inputs (a tuple, oldest first) and
    SiLU(conv), rounded to the activation dtype as the reference stores activations."""
    window = ()
    y = tl.zeros(ch.shape, tl.float32)
    for j in tl.static_range(W):
        pos = t - (W - 1) + j  # position of window input j within the row
        x = tl.load(qkv_ptr + (start + pos) * stride_qkv + ch, mask=pos >= 0, other=0.0).to(tl.float32)
        for i in tl.static_range(W - 1):  # before the row: conv-state column t + j
            x = tl.where(t + j == i, hist[i], x)
        window = window + (x,)
        y += tl.load(w_ptr + ch * stride_w + j).to(tl.float32) * x
    y = y * tl.sigmoid(y)
    return window, y.to(qkv_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _store_conv_state(cs_ptr, ch, stride_c, stride_w, window, W: tl.constexpr):
    """The conv state after a token is its window's last W - 1 inputs."""
    for i in tl.static_range(W - 1):
        tl.store(cs_ptr + ch * stride_c + i * stride_w, window[i + 1].to(cs_ptr.dtype.element_ty))


@triton.jit
def _fused_kda_decode_kernel(
    qkv_ptr, gate_ptr, beta_ptr, ogate_ptr, out_ptr,
    conv_w_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr,
    conv_state_ptr, ssm_ptr, qsl_ptr, idx_ptr, nacc_ptr,
    stride_qkv, stride_gate, stride_beta, stride_ogate, stride_out, stride_cw,
    stride_cs_slot, stride_cs_c, stride_cs_w, stride_ssm_slot, stride_idx,
    norm_eps, lower_bound, q_scale,
    P: tl.constexpr, K: tl.constexpr, W: tl.constexpr, MAX_T: tl.constexpr,
    BOUNDED: tl.constexpr, SPEC: tl.constexpr,
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

    offs = tl.arange(0, K)
    ch = h * K + offs  # this head's channels within q, k, v, gate and output
    state_offs = h * K * K + offs[:, None] * K + offs[None, :]  # [V, K], K contiguous
    src_conv = conv_state_ptr + src * stride_cs_slot
    S = tl.load(ssm_ptr + src * stride_ssm_slot + state_offs).to(tl.float32)
    hist_q = _load_conv_state(src_conv, ch, stride_cs_c, stride_cs_w, W)
    hist_k = _load_conv_state(src_conv, P + ch, stride_cs_c, stride_cs_w, W)
    hist_v = _load_conv_state(src_conv, 2 * P + ch, stride_cs_c, stride_cs_w, W)
    # The stores below go back in place, and the compiler may give a store another thread-to-element map than
    # the load of the same address had: every thread of the program must have finished its loads first.
    tl.debug_barrier()

    a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + ch).to(tl.float32)
    norm_w = tl.load(norm_w_ptr + offs).to(tl.float32)
    for t in tl.range(0, MAX_T):
        if t < length:
            tok = start + t
            win_q, q = _conv_silu(qkv_ptr, stride_qkv, start, t, ch, hist_q, conv_w_ptr, stride_cw, W)
            win_k, k = _conv_silu(qkv_ptr, stride_qkv, start, t, P + ch, hist_k, conv_w_ptr, stride_cw, W)
            win_v, v = _conv_silu(qkv_ptr, stride_qkv, start, t, 2 * P + ch, hist_v, conv_w_ptr, stride_cw, W)
            q = q * tl.rsqrt(tl.sum(q * q) + L2NORM_EPS) * q_scale
            k = k * tl.rsqrt(tl.sum(k * k) + L2NORM_EPS)

            s = tl.load(gate_ptr + tok * stride_gate + ch).to(tl.float32) + dt_bias
            if BOUNDED:
                g = lower_bound * tl.sigmoid(a * s)
            else:  # -a * softplus(s), in the overflow-free form
                softplus = tl.maximum(s, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(s)))
                g = -a * tl.where(s > SOFTPLUS_LINEAR_ABOVE, s, softplus)
            beta = tl.sigmoid(tl.load(beta_ptr + tok * stride_beta + h).to(tl.float32))

            S = S * tl.exp(g)[None, :]
            c = beta * (v - tl.sum(S * k[None, :], axis=1))
            S = S + c[:, None] * k[None, :]
            o = tl.sum(S * q[None, :], axis=1)

            # Gated RMSNorm of the core output, which the reference rounds to the activation dtype first.
            o = o.to(out_ptr.dtype.element_ty).to(tl.float32)
            o = o * tl.rsqrt(tl.sum(o * o) / K + norm_eps) * norm_w
            o = o * tl.sigmoid(tl.load(ogate_ptr + tok * stride_ogate + ch).to(tl.float32))
            tl.store(out_ptr + tok * stride_out + ch, o.to(out_ptr.dtype.element_ty))

            # Plain decode writes the final state back to the source slot; speculative decoding writes the
            # state after every token to that token's checkpoint column.
            if SPEC:
                dst = tl.load(idx_ptr + r * stride_idx + t).to(tl.int64)
                save = dst >= 0
            else:
                dst = src
                save = t == length - 1
            if save:
                tl.store(ssm_ptr + dst * stride_ssm_slot + state_offs, S.to(ssm_ptr.dtype.element_ty))
                dst_conv = conv_state_ptr + dst * stride_cs_slot
                _store_conv_state(dst_conv, ch, stride_cs_c, stride_cs_w, win_q, W)
                _store_conv_state(dst_conv, P + ch, stride_cs_c, stride_cs_w, win_k, W)
                _store_conv_state(dst_conv, 2 * P + ch, stride_cs_c, stride_cs_w, win_v, W)


def fused_kda_decode(mixed_qkv: torch.Tensor, raw_gate: torch.Tensor, raw_beta: torch.Tensor,
                     output_gate: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
                     dt_bias: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float, lower_bound: float | None,
                     conv_state: torch.Tensor, ssm_state: torch.Tensor, query_start_loc: torch.Tensor,
                     state_indices: torch.Tensor, num_accepted_tokens: torch.Tensor | None = None, *,
                     num_heads: int, head_dim: int, max_query_len: int, out: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """KDA over decode rows of 1..max_query_len tokens; returns the gated-normalised output [T, H*K].

    mixed_qkv [T, 3P] (pre-conv), raw_gate [T, P], raw_beta [T, H], output_gate [T, P], conv_weight [3P, W],
    A_log [H], dt_bias [P], norm_weight [K]. conv_state [slots, 3P, W-1] and ssm_state [slots, H, V, K]
    (float32 or bfloat16) are updated in place. Request r owns tokens query_start_loc[r]:query_start_loc[r+1].
    state_indices [N] gives each request's slot; [N, C] gives checkpoint columns: the state is read from column
    num_accepted_tokens[r] - 1 and the state after token t written to column t. Rows with no tokens or a
    negative slot are skipped, and their output rows left as they are (uninitialised when `out` is None).
    """
    H, K = num_heads, head_dim
    P, W = H * K, conv_weight.shape[-1]
    T, N = mixed_qkv.shape[0], state_indices.shape[0]
    assert K & (K - 1) == 0, "head_dim must be a power of two (the state tile is unmasked)"
    assert mixed_qkv.shape[-1] == 3 * P and conv_state.shape[1:] == (3 * P, W - 1)
    assert ssm_state.shape[1:] == (H, K, K) and ssm_state[0].is_contiguous()
    spec = state_indices.dim() == 2
    if spec:
        assert num_accepted_tokens is not None and state_indices.shape[1] >= max_query_len
    if out is None:
        out = mixed_qkv.new_empty(T, P)
    for x in (mixed_qkv, raw_gate, raw_beta, output_gate, out, conv_weight, A_log, dt_bias, norm_weight):
        assert x.stride(-1) == 1, "channels must be contiguous"
    if N == 0 or T == 0:
        return out
    _fused_kda_decode_kernel[(N, H)](
        mixed_qkv, raw_gate, raw_beta, output_gate, out,
        conv_weight, A_log, dt_bias, norm_weight,
        conv_state, ssm_state, query_start_loc, state_indices,
        num_accepted_tokens if spec else state_indices,
        mixed_qkv.stride(0), raw_gate.stride(0), raw_beta.stride(0), output_gate.stride(0), out.stride(0),
        conv_weight.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        ssm_state.stride(0), state_indices.stride(0),
        norm_eps, 0.0 if lower_bound is None else lower_bound, K ** -0.5,
        P=P, K=K, W=W, MAX_T=max_query_len,
        BOUNDED=lower_bound is not None, SPEC=spec,
        # About 64 fp32 state elements per thread: 8 warps for the 128 x 128 tile.
        num_warps=max(1, min(8, K * K // (32 * 64))),
    )
    return out


class NativeKDABackend(KDABackend):
    """`--kda-decode-backend native`: the fused kernel above, for decode rows of 1..max_query_len tokens."""
    name = "native"
    runs_decode = True
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
            rows.query_start_loc, rows.state_indices, num_heads=layer.num_heads, head_dim=layer.head_dim,
            max_query_len=rows.max_query_len)
