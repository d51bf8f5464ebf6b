"""FlashInfer's KDA kernels (Blackwell sm100/sm103) as a KDA backend for both prefill and decode.

Decode: `flashinfer.kda_decode.fused_kda_decode` — width-4 conv + SiLU, one KDA step and gated RMSNorm in one
launch, one token per row. Mapping: x = mixed_qkv [N, 3P] (pre-conv); weight = conv_weight [3P, 4] as
[3, 4, P] fp32; conv_state [slots, 3P, 3] bf16 in the "SD" layout (strides [slot, 1, 3P]; a pool in the
engine's contiguous layout is staged through such a buffer for the rows' slots); raw_gate [1, N, H, 128];
raw_beta [1, N, H]; A_log [H], dt_bias [P] fp32; state_indices int32 [N]; state = ssm_state [slots, H, V, K]
fp32 or bf16 (the kernel reads row v of a head's matrix against the K channels: the engine's [V, K] layout);
output_gate [N, H, 128]; norm_weight [128] fp32; lower_bound None selects the softplus gate. The kernel takes
device slot indices only, so a decode batch of one-token rows can replay in a CUDA graph.

Not covered, refused loudly:
  * multi-token decode rows (speculative verification). FlashInfer's `packed_fused_kda_decode` handles them but
    needs per-token checkpoint slots (state_indices [N, 1+K]), num_accepted_tokens and a conv window of 1+K+2
    columns per request — a pool layout this engine does not allocate yet.
  * state slot 0: FlashInfer reserves it as a null slot (zero output, no state update). The engine keeps slot 0
    as its own null slot (core/kv_cache_manager.NULL_STATE_SLOT), so only padding points there; a decode row in
    slot 0 raises instead of silently returning zeros.
  Newer FlashInfer builds also classify state_indices on the host (cached per tensor object) on sm100; there a
  capture with a state_indices tensor not seen eagerly before raises inside FlashInfer.

Prefill: `flashinfer.kda.recurrent_kda`, the facade that routes ordinary packed multi-token prefill with the
bounded gate to FlashInfer's FlashKDA port (other calls — the softplus gate, all-one-token groups — go to its
generic CuTe-DSL recurrent kernel). Same contract as FlashKDA (kernel-side l2norm, gate and beta sigmoid), so it
shares flashkda.run_varlen_prefill: our Triton conv, initial states gathered by slot, final states scattered back.
recurrent_kda takes bf16 state only, so an fp32 pool is rounded to bf16 at each prompt chunk's boundary
(decode steps keep fp32).

Facts from FlashInfer's kda_decode.py / kda.py docstrings, kda_kernels/fused_kda_decode.py (argument checks and
kernel layouts) and docs.flashinfer.ai. Where it ran: only against fakes of those APIs on CPU
(tests/attention/test_flashinfer_glue.py); no Blackwell GPU was available, so no real kernel has run this glue.
"""
from __future__ import annotations

import importlib

import torch

from vllm.attention.backend import AttentionCGSupport, LayerShapes
from vllm.attention.kda.flashkda import run_varlen_prefill
from vllm.attention.kda.metadata import KDABackend, KDARows, KDAWeights

BLACKWELL = ((10, 0), (10, 3))
# fused_kda_decode's head counts (its docstring and _SUPPORTED_HEADS); head_dim is fixed at 128.
DECODE_HEADS = (12, 24, 32, 48, 96)
CONV_WIDTH = 4


class FlashInferKDABackend(KDABackend):
    name = "flashinfer"
    runs_prefill = runs_decode = True
    # One-token rows only (see the module docstring), addressed by device slot indices.
    decode_cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, shapes: LayerShapes | None = None) -> str | None:
        try:
            decode = importlib.import_module("flashinfer.kda_decode")
            facade = importlib.import_module("flashinfer.kda")
        except (ImportError, RuntimeError, OSError) as e:
            return f"flashinfer is not importable ({e}); pip install 'vllm[flashinfer]'"
        for module, fn in ((decode, "fused_kda_decode"), (facade, "recurrent_kda")):
            if not hasattr(module, fn):
                return f"this flashinfer has no {module.__name__}.{fn}; needs flashinfer-python with its KDA kernels"
        if device.type != "cuda":
            return f"needs a CUDA device (sm100/sm103), got {device}"
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) not in BLACKWELL:
            return f"FlashInfer's KDA kernels need sm100/sm103 (Blackwell), this device is sm{major}{minor}"
        if dtype != torch.bfloat16:
            return f"takes bf16 activations only, the model runs in {dtype}"
        if shapes is None:
            return None
        if shapes.kda_head_dim != 128:
            return f"needs KDA head_dim 128, the model has {shapes.kda_head_dim}"
        if shapes.kda_num_heads not in DECODE_HEADS:
            return f"fused_kda_decode takes {DECODE_HEADS} heads, the model has {shapes.kda_num_heads} (per rank)"
        if shapes.ssm_state_dtype not in (torch.float32, torch.bfloat16):
            return f"keeps state in fp32 or bf16, the state pool is {shapes.ssm_state_dtype}"
        return None

    @classmethod
    def forward_decode(cls, layer: KDAWeights, mixed_qkv: torch.Tensor, raw_gate: torch.Tensor,
                       raw_beta: torch.Tensor, output_gate: torch.Tensor, conv_state: torch.Tensor,
                       ssm_state: torch.Tensor, rows: KDARows) -> torch.Tensor:
        from flashinfer.kda_decode import fused_kda_decode

        if rows.max_query_len > 1:
            raise NotImplementedError(
                f"FlashInfer KDA decode runs one token per row; this step has rows of up to {rows.max_query_len} "
                "tokens (speculative verification). packed_fused_kda_decode would need per-token checkpoint "
                "slots the engine does not allocate; use --kda-decode-backend native or triton")
        if bool((rows.state_indices_cpu == 0).any()):
            raise ValueError(
                "FlashInfer's fused_kda_decode reserves state slot 0 as a null slot (zero output, no update), "
                "but a decode row holds slot 0; the engine must not hand out KDA state slot 0 to use it")
        H, K = layer.num_heads, layer.head_dim
        N, P = rows.num_reqs, H * K
        width = layer.conv_weight.shape[-1]
        if width != CONV_WIDTH:
            raise ValueError(f"fused_kda_decode's conv is {CONV_WIDTH} wide, this layer's is {width}")
        slots = rows.state_indices.long()
        conv = _sd_layout(conv_state, slots)
        out = fused_kda_decode(
            x=mixed_qkv[:N], weight=layer.conv_weight.float().view(3, P, width).transpose(1, 2).contiguous(),
            conv_state=conv, raw_gate=raw_gate[:N].view(1, N, H, K), raw_beta=raw_beta[:N].view(1, N, H),
            A_log=layer.A_log.float().contiguous(), dt_bias=layer.dt_bias.float().contiguous(),
            state_indices=rows.state_indices, state=ssm_state, output_gate=output_gate[:N].view(N, H, K),
            norm_weight=layer.o_norm.weight.float().contiguous(), lower_bound=layer.gate_lower_bound,
            norm_eps=layer.o_norm.eps)
        if conv is not conv_state:
            conv_state[slots] = conv[slots]
        return out.view(N, P)

    @classmethod
    def forward_prefill(cls, layer: KDAWeights, mixed_qkv: torch.Tensor, raw_gate: torch.Tensor,
                        raw_beta: torch.Tensor, output_gate: torch.Tensor, conv_state: torch.Tensor,
                        ssm_state: torch.Tensor, rows: KDARows) -> torch.Tensor:
        from flashinfer.kda import recurrent_kda

        A_log, dt_bias = layer.A_log.float().contiguous(), layer.dt_bias.float().contiguous()

        def kernel(q, k, v, g, beta, h0, cu_seqlens):
            return recurrent_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=layer.head_dim ** -0.5,
                                 initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                 use_gate_in_kernel=True, lower_bound=layer.gate_lower_bound, cu_seqlens=cu_seqlens,
                                 beta_is_logit=True)

        return run_varlen_prefill(layer, mixed_qkv, raw_gate, raw_beta, output_gate, conv_state, ssm_state, rows,
                                  kernel, state_dtype=torch.bfloat16)


def _sd_layout(conv_state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """conv_state itself if it already has the kernel's [slot, 1, C] strides, else a buffer of that layout
    holding the rows' slots (the caller copies them back). Only these slots are read or written by the kernel."""
    if conv_state.stride(1) == 1:
        return conv_state
    num_slots, channels, history = conv_state.shape
    staged = conv_state.new_empty(num_slots, history, channels).transpose(1, 2)
    staged[slots] = conv_state[slots]
    return staged
