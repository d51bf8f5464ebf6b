"""FlashKDA (MoonshotAI/FlashKDA, `flash_kda.fwd`): a KDA prefill-only backend, and the varlen prefill glue
that FlashInfer's FlashKDA port (attention/kda/flashinfer.py) shares.

`flash_kda.fwd` takes post-conv, post-SiLU q/k/v (it L2-normalises q and k itself), the raw gate with A_log
and dt_bias (it applies the bounded gate lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) itself; it has no
softplus gate), raw beta logits (sigmoid inside), bf16 activations, K = V = 128, and initial/final states
[N, H, V, K] in bf16 or fp32 — the engine's pool layout, so states go in and out in the pool dtype with no
conversion. It has no conv, so the conv step is ours (attention/kda/conv.py, Triton); initial states are
gathered from the pool by slot (zeros for fresh prompts) and final states scattered back.
Facts from FlashKDA's README, csrc/flash_kda.cpp argument checks and csrc/smxx/fwd_kernel1.cuh.

Where it ran: on the H200 (sm90a build, 2026-12-01) against the torch reference and end to end in the engine,
and measured faster than the fla-based `triton` prefill at every shape run, so `auto` takes it where its
constraints hold (docs/backends.md). The library needs CUDA >= 12.9 and is not on PyPI: build it from its
repository; on CPU its glue is tested against a stub with the built module's signature.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from vllm.attention.backend import LayerShapes
from vllm.attention.kda.conv import causal_conv1d_silu
from vllm.attention.kda.metadata import KDABackend, KDARows, KDAWeights
from vllm.attention.kda.norm import fused_gated_norm

# (q, k, v, raw_gate, raw_beta, initial_state, cu_seqlens int64) -> (o [1, T, H, V], final_state [N, H, V, K])
PrefillKernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class FlashKDABackend(KDABackend):
    name = "flashkda"
    runs_prefill = True

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, shapes: LayerShapes | None = None) -> str | None:
        try:
            importlib.import_module("flash_kda")
        except (ImportError, RuntimeError, OSError) as e:
            return (f"flash_kda is not importable ({e}); it is not on PyPI: build it from "
                    "https://github.com/MoonshotAI/FlashKDA (CUDA >= 12.9)")
        if device.type != "cuda":
            return f"needs a CUDA device (sm90 or newer), got {device}"
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (9, 0):
            return f"needs sm90 or newer, this device is sm{major}{minor}"
        if dtype != torch.bfloat16:
            return f"takes bf16 activations only, the model runs in {dtype}"
        if shapes is None:
            return None
        if shapes.kda_head_dim != 128:
            return f"needs KDA head_dim 128 (K = V = 128), the model has {shapes.kda_head_dim}"
        if not shapes.kda_gate_bounded:
            return ("implements only the bounded gate lower_bound * sigmoid(exp(A_log) * (g + dt_bias)); "
                    "this model uses the softplus gate -exp(A_log) * softplus(g + dt_bias)")
        if shapes.ssm_state_dtype not in (torch.float32, torch.bfloat16):
            return f"keeps state in fp32 or bf16, the state pool is {shapes.ssm_state_dtype}"
        return None

    @classmethod
    def forward_prefill(cls, layer: KDAWeights, mixed_qkv: torch.Tensor, raw_gate: torch.Tensor,
                        raw_beta: torch.Tensor, output_gate: torch.Tensor, conv_state: torch.Tensor,
                        ssm_state: torch.Tensor, rows: KDARows) -> torch.Tensor:
        import flash_kda

        if layer.gate_lower_bound is None:
            raise ValueError("FlashKDA needs the bounded gate (gate_lower_bound); this layer has none")
        H, K = layer.num_heads, layer.head_dim
        A_log = layer.A_log.float().contiguous()
        dt_bias = layer.dt_bias.float().view(H, K).contiguous()

        def kernel(q, k, v, g, beta, h0, cu_seqlens):
            out = torch.empty_like(v)
            final = torch.empty_like(h0)
            flash_kda.fwd(q, k, v, g, beta, K ** -0.5, out, A_log, dt_bias, float(layer.gate_lower_bound),
                          initial_state=h0, final_state=final, cu_seqlens=cu_seqlens)
            return out, final

        return run_varlen_prefill(layer, mixed_qkv, raw_gate, raw_beta, output_gate, conv_state, ssm_state, rows,
                                  kernel, state_dtype=ssm_state.dtype)


def run_varlen_prefill(layer: KDAWeights, mixed_qkv: torch.Tensor, raw_gate: torch.Tensor, raw_beta: torch.Tensor,
                       output_gate: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, rows: KDARows,
                       kernel: PrefillKernel, state_dtype: torch.dtype) -> torch.Tensor:
    """The FlashKDA-contract prefill around `kernel`: conv + SiLU (ours), the recurrence there, gated norm here.

    The kernel gets contiguous [1, T, H, K] q/k/v/gate, [1, T, H] beta logits, initial states [N, H, V, K] in
    `state_dtype` (zeros where has_initial_state is False) and int64 cu_seqlens. Rows with no tokens keep their
    pools untouched. Host work (index building) is fine here: prefill steps are never graph-captured.
    """
    H, K = layer.num_heads, layer.head_dim
    T = rows.num_tokens
    act = mixed_qkv.dtype
    slots = rows.state_indices.long()
    qsl = rows.query_start_loc_cpu.long()
    if bool((rows.state_indices_cpu < 0).any()):
        # A negative slot would silently index the pool from its end.
        raise ValueError(f"prefill rows need state slots >= 0, got {rows.state_indices_cpu.tolist()}")
    # Our Triton conv (conv.py): SiLU output rounded to the activation dtype, which is what the kernel reads.
    x = causal_conv1d_silu(mixed_qkv[:T], layer.conv_weight, conv_state, rows.query_start_loc, rows.state_indices,
                           rows.has_initial_state, rows.max_query_len, num_splits=3)
    q, k, v = (t.view(1, T, H, K) for t in x)
    fresh = ~rows.has_initial_state[:, None, None, None]
    h0 = ssm_state[slots].masked_fill(fresh, 0).to(state_dtype).contiguous()
    o, final = kernel(q, k, v, raw_gate[:T].reshape(1, T, H, K).contiguous(),
                      raw_beta[:T].reshape(1, T, H).contiguous(), h0, rows.query_start_loc.long())
    live = (qsl[1:] > qsl[:-1]).nonzero().flatten().to(slots.device)
    ssm_state[slots[live]] = final[live].to(ssm_state.dtype)
    return fused_gated_norm(layer, o.reshape(T, H, K), output_gate[:T], act)

