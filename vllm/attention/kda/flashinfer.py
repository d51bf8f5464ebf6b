"""FlashInfer's KDA kernels (Blackwell sm100/sm103) as a KDA backend for both prefill and decode.

Decode: `flashinfer.kda_decode.fused_kda_decode` — width-4 conv + SiLU, one KDA step and gated RMSNorm in one
launch, one token per row. Mapping: x = mixed_qkv [N, 3P] (pre-conv); weight = conv_weight [3P, 4] as
[3, 4, P] fp32; conv_state [slots, 3P, 3] bf16 in its "SD" layout (strides [slot, 1, 3P]): the engine
allocates the pools that way when this backend decodes (`conv_state_history_major`), and every other KDA
kernel reads that layout through strides, so nothing is staged; raw_gate [1, N, H, 128]; raw_beta [1, N, H];
A_log [H], dt_bias [P] fp32; state_indices int32 [N]; state = ssm_state [slots, H, V, K] fp32 or bf16 (the
kernel reads row v of a head's matrix against the K channels: the engine's [V, K] layout); output_gate
[N, H, 128]; norm_weight [128] fp32; lower_bound None selects the softplus gate. The kernel takes device slot
indices only, so a decode batch of one-token rows replays in a CUDA graph.

The null slot: FlashInfer reads a non-positive slot as "no state" (zero output, neither cache touched), and the
engine's own null slot is 0 too (core/kv_cache_manager.NULL_STATE_SLOT), never handed to a request. So graph
capture dummies and padding rows, which sit on slot 0, read and write nothing — exactly what they need.

Not covered, refused loudly: multi-token decode rows (speculative verification). FlashInfer's
`packed_fused_kda_decode` handles them, but keeps one rolling conv window of 1+K+2 columns per request in its
first checkpoint slot, where the engine keeps a W-1 window in every checkpoint slot.

Prefill: `flashinfer.kda.recurrent_kda`, the facade that routes ordinary packed multi-token prefill with the
bounded gate to FlashInfer's FlashKDA port (other calls — the softplus gate, all-one-token groups — go to its
generic CuTe-DSL recurrent kernel). Same contract as FlashKDA (kernel-side l2norm, gate and beta sigmoid), so it
shares flashkda.run_varlen_prefill: our Triton conv, initial states gathered by slot in the pool's dtype (its
prefill backends take bf16 or fp32 states), final states scattered back.

Facts from FlashInfer 0.7.2.post1's kda_decode.py / kda.py docstrings and docs.flashinfer.ai. Where it ran: no
Blackwell GPU was available, so no real kernel has run this glue; tests/attention/test_flashinfer_glue.py binds
every call to the installed library's real signatures on CPU and checks it against reference math.
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
    conv_state_history_major = True

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
                "tokens (speculative verification), whose checkpoint layout fused_kda_decode does not take; use "
                "--kda-decode-backend native")
        if conv_state.stride(1) != 1:
            raise ValueError("fused_kda_decode reads conv states history-major (strides [slot, 1, 3P]); this pool "
                             f"has strides {tuple(conv_state.stride())}. The engine allocates that layout when "
                             "FlashInfer decodes (KDABackend.conv_state_history_major)")
        H, K = layer.num_heads, layer.head_dim
        N = rows.num_reqs
        w = _decode_weights(layer)
        out = fused_kda_decode(
            x=mixed_qkv[:N], weight=w.conv, conv_state=conv_state, raw_gate=raw_gate[:N].view(1, N, H, K),
            raw_beta=raw_beta[:N].view(1, N, H), A_log=w.A_log, dt_bias=w.dt_bias, state_indices=rows.state_indices,
            state=ssm_state, output_gate=output_gate[:N].view(N, H, K), norm_weight=w.norm,
            lower_bound=layer.gate_lower_bound, norm_eps=layer.o_norm.eps)
        return out.view(N, H * K)

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
                                  kernel, state_dtype=ssm_state.dtype)


class _DecodeWeights:
    """A layer's weights in the dtypes and layouts fused_kda_decode takes, made once (outside any graph capture:
    the first call is an eager warm-up) instead of converted on every step."""

    def __init__(self, layer: KDAWeights) -> None:
        width = layer.conv_weight.shape[-1]
        if width != CONV_WIDTH:
            raise ValueError(f"fused_kda_decode's conv is {CONV_WIDTH} wide, this layer's is {width}")
        P = layer.num_heads * layer.head_dim
        self.conv = layer.conv_weight.float().view(3, P, width).transpose(1, 2).contiguous()
        self.A_log = layer.A_log.float().contiguous()
        self.dt_bias = layer.dt_bias.float().contiguous()
        self.norm = layer.o_norm.weight.float().contiguous()


def _decode_weights(layer: KDAWeights) -> _DecodeWeights:
    weights = getattr(layer, "_flashinfer_decode_weights", None)
    if weights is None:
        weights = layer._flashinfer_decode_weights = _DecodeWeights(layer)
    return weights
