"""The `triton` KDA backend: fla-core's Triton kernels over our state pools.

Prefill: `chunk_kda` over all prompt chunks as one varlen sequence batch (cu_seqlens), initial states
gathered from the pool (zeros for fresh prompts; fla takes fp32 initial states only) and final states
scattered back in the pool's dtype. Steps whose prompt chunks are all short take fla's recurrent kernel
instead (same inputs, same math, token by token in one launch): chunk_kda is ~10 Triton launches through
autotuners, ~1.5-3 ms of host time per layer against 0.1-0.3 ms of kernels for short chunks (2026-12-07f in
docs/performance.md), which made a decode step that also carried one short prompt chunk cost 20-33 ms instead
of 3 (1.3B config, H200); the recurrent kernel's time grows with the chunk length (~1.5 us a token), so long
chunks keep chunk_kda. `recurrent_prefill_max_len` is where the two cross for a full
batch (benchmarks/kernels/bench_kda_prefill.py --prompts 1,32, 16 heads: 32 prompts x 256 tokens 2.80 against
2.82 ms, one prompt of 256 0.44 against 1.73 ms). Once the GPU is full the recurrent kernel costs ~0.34 us
per token (32 x 512 tokens: 5.46 against 2.14 ms), so a step of more than `recurrent_prefill_max_tokens`
prompt tokens keeps chunk_kda whatever its chunks' lengths. Decode: `fused_recurrent_kda_fwd` reads and writes the pool
in place by state index. Both compute the gate, l2norm and beta sigmoid in-kernel; the conv is ours (conv.py), since
fla keeps conv states in another layout, and the gated RMSNorm is our one-launch kernel (norm.py).

fla's in-place pool path writes the state after token t to index column t of the row, so rows of more than
one token with one slot each (1-D indices) would write into their neighbours' slots: such decode groups
take the gather/scatter path instead. fla-core's kernels do not run under Triton's CPU interpreter.
"""
from __future__ import annotations

import torch

from vllm.attention.backend import AttentionCGSupport, LayerShapes
from vllm.attention.kda.conv import causal_conv1d_silu
from vllm.attention.kda.metadata import KDABackend, KDARows, KDAWeights
from vllm.attention.kda.norm import fused_gated_norm


class TritonFLAKDABackend(KDABackend):
    name = "triton"
    runs_prefill = runs_decode = True
    decode_cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    # Prompt chunks up to this many tokens, in steps of up to this many prompt tokens, run through the recurrent
    # kernel (module docstring).
    recurrent_prefill_max_len = 256
    recurrent_prefill_max_tokens = 8192

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, shapes: LayerShapes | None = None) -> str | None:
        if device.type != "cuda":
            return f"fla-core's Triton kernels need a CUDA GPU (device is {device})"
        try:
            import fla.ops.kda  # noqa: F401
        except ImportError as e:
            return f"needs fla-core ({e}); pip install 'vllm[cuda]'"
        return None

    @classmethod
    def forward_decode(cls, layer: KDAWeights, mixed_qkv: torch.Tensor, raw_gate: torch.Tensor,
                       raw_beta: torch.Tensor, output_gate: torch.Tensor, conv_state: torch.Tensor,
                       ssm_state: torch.Tensor, rows: KDARows) -> torch.Tensor:
        if rows.max_query_len > 1:
            return cls._varlen(layer, mixed_qkv, raw_gate, raw_beta, output_gate, conv_state, ssm_state, rows)
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
        q, k, v = _conv(layer, mixed_qkv, conv_state, rows)
        H, K, T = layer.num_heads, layer.head_dim, rows.num_tokens
        o, _ = fused_recurrent_kda_fwd(
            q, k, v, raw_gate[:T].view(1, T, H, K), _fla_beta(raw_beta, T), A_log=layer.A_log,
            dt_bias=layer.dt_bias, initial_state=ssm_state, scale=K ** -0.5, inplace_final_state=True,
            state_v_first=True, cu_seqlens=rows.query_start_loc, ssm_state_indices=rows.state_indices,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            lower_bound=layer.gate_lower_bound)
        return fused_gated_norm(layer, o[0], output_gate[:T], mixed_qkv.dtype)

    @classmethod
    def forward_prefill(cls, layer: KDAWeights, mixed_qkv: torch.Tensor, raw_gate: torch.Tensor,
                        raw_beta: torch.Tensor, output_gate: torch.Tensor, conv_state: torch.Tensor,
                        ssm_state: torch.Tensor, rows: KDARows) -> torch.Tensor:
        return cls._varlen(layer, mixed_qkv, raw_gate, raw_beta, output_gate, conv_state, ssm_state, rows,
                           chunked=rows.max_query_len > cls.recurrent_prefill_max_len
                           or rows.num_tokens > cls.recurrent_prefill_max_tokens)

    @staticmethod
    def _varlen(layer, mixed_qkv, raw_gate, raw_beta, output_gate, conv_state, ssm_state, rows, chunked=False):
        from fla.ops.kda import chunk_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
        q, k, v = _conv(layer, mixed_qkv, conv_state, rows)
        H, K, T = layer.num_heads, layer.head_dim, rows.num_tokens
        slots = rows.state_indices.long()
        init = ssm_state[slots].float() * rows.has_initial_state[:, None, None, None]
        gate_args = dict(A_log=layer.A_log, dt_bias=layer.dt_bias, use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                         lower_bound=layer.gate_lower_bound, state_v_first=True, scale=K ** -0.5)
        g, beta = raw_gate[:T].view(1, T, H, K), _fla_beta(raw_beta, T)
        if chunked:
            cu_seqlens, cu_seqlens_cpu = rows.offsets_int64()
            o, final = chunk_kda(q, k, v, g, beta, initial_state=init, output_final_state=True,
                                 safe_gate=layer.gate_lower_bound is not None, cu_seqlens=cu_seqlens,
                                 cu_seqlens_cpu=cu_seqlens_cpu, **gate_args)
        else:
            o, final = fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=init, output_final_state=True,
                                               inplace_final_state=False, cu_seqlens=rows.query_start_loc,
                                               **gate_args)
        ssm_state[slots] = final.to(ssm_state.dtype)
        return fused_gated_norm(layer, o[0], output_gate[:T], mixed_qkv.dtype)


def _fla_beta(raw_beta: torch.Tensor, T: int) -> torch.Tensor:
    """[1, T, H] for fla, whose kernels address beta as contiguous [T, H]: the model's raw_beta is a column slice
    of its projection (rows strided), which read as is gives every token but the first other values as betas."""
    return raw_beta[:T].contiguous().view(1, T, -1)


def _conv(layer: KDAWeights, mixed_qkv: torch.Tensor, conv_state: torch.Tensor, rows: KDARows):
    """Conv + SiLU, then q, k, v as [1, T, H, K] views for fla."""
    T, H, K = rows.num_tokens, layer.num_heads, layer.head_dim
    x = causal_conv1d_silu(mixed_qkv[:T], layer.conv_weight, conv_state, rows.query_start_loc,
                           rows.state_indices, rows.has_initial_state, rows.max_query_len, num_splits=3)
    return (t.view(1, T, H, K) for t in x)

