"""The torch reference KDA backend: conv-state update, gate, recurrence and gated RMSNorm over state pools.

Prompt-chunk rows run the chunked form, decode rows the token-recurrent form; each reads its request's
state slot (zeros for a fresh request) and writes the final state back in the pool's dtype. One-token decode
rows (the common case) run as one batched step over all of them; other rows run one request at a time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from vllm.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionMetadataBuilder,
                                    CommonAttentionMetadata, QueryLenSupport)
from vllm.attention.kda.ops import causal_conv1d, kda_chunked, kda_gate, kda_recurrent, l2norm
from vllm.model_executor.layers.layernorm import RMSNormGated


class KDAWeights(Protocol):
    """What a KDA backend reads from the layer (see models/kimi_k3/kda.py)."""
    num_heads: int
    head_dim: int
    gate_lower_bound: float | None
    conv_weight: torch.Tensor  # [3P, W], q/k/v channels stacked
    A_log: torch.Tensor  # [H] float32
    dt_bias: torch.Tensor  # [P] float32
    o_norm: RMSNormGated


@dataclass(slots=True)
class TorchKDAMetadata:
    """Host-side copies taken once per step so the per-layer loops never sync with the device."""
    query_start_loc: list[int]
    state_indices: list[int]
    has_initial_state: list[bool]
    is_prefilling: list[bool]
    # One-token decode rows, batched: their token index and state slot (device), and their row numbers.
    decode_token_idx: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    decode_rows: frozenset[int] = frozenset()


class TorchKDAMetadataBuilder(AttentionMetadataBuilder):
    cudagraph_support = AttentionCGSupport.NEVER
    query_len_support = QueryLenSupport.VARLEN

    def build(self, common: CommonAttentionMetadata) -> TorchKDAMetadata:
        n = common.num_reqs
        meta = TorchKDAMetadata(
            query_start_loc=common.query_start_loc_cpu[:n + 1].tolist(),
            state_indices=common.state_indices_cpu[:n].tolist(),
            has_initial_state=(common.num_computed_tokens_cpu[:n] > 0).tolist(),
            is_prefilling=common.is_prefilling[:n].tolist(),
        )
        rows = common.single_token_decode_rows()
        if len(rows):
            device = common.state_indices.device
            meta.decode_token_idx = common.query_start_loc_cpu[rows].long().to(device)
            meta.decode_slots = common.state_indices[rows.to(device)].long()
            meta.decode_rows = frozenset(rows.tolist())
        return meta


class TorchKDABackend(AttentionBackend):
    name = "TORCH_KDA"

    @classmethod
    def builder(cls, block_size: int) -> TorchKDAMetadataBuilder:
        return TorchKDAMetadataBuilder()

    @staticmethod
    def forward(layer: KDAWeights, mixed_qkv: torch.Tensor, raw_gate: torch.Tensor, raw_beta: torch.Tensor,
                output_gate: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                meta: TorchKDAMetadata) -> torch.Tensor:
        """mixed_qkv [T, 3P] (pre-conv), raw_gate [T, P], raw_beta [T, H], output_gate [T, P].

        conv_state [slots, 3P, W-1] and ssm_state [slots, H, V, K] are updated in place.
        Returns the gated-normalised core output [T, P] in the activation dtype.
        """
        H, K = layer.num_heads, layer.head_dim
        g = kda_gate(raw_gate, layer.A_log, layer.dt_bias, K, layer.gate_lower_bound)
        beta = torch.sigmoid(raw_beta.float())
        core = mixed_qkv.new_empty(mixed_qkv.shape[0], H, K, dtype=torch.float32)
        if meta.decode_token_idx is not None:
            idx, slots = meta.decode_token_idx, meta.decode_slots
            window = torch.cat([conv_state[slots], mixed_qkv[idx, :, None].to(conv_state.dtype)], dim=-1)
            conv_state[slots] = window[..., 1:]
            q, k, v = _qkv((window.float() * layer.conv_weight.float()).sum(-1), mixed_qkv.dtype, H, K)
            # Requests are independent, so N requests x H heads run as N*H heads of one recurrent step.
            N = idx.shape[0]
            o, S = kda_recurrent(q.reshape(1, N * H, K), k.reshape(1, N * H, K), v.reshape(1, N * H, K),
                                 g[idx].reshape(1, N * H, K), beta[idx].reshape(1, N * H),
                                 ssm_state[slots].reshape(N * H, K, K))
            core[idx] = o.view(N, H, K)
            ssm_state[slots] = S.view(N, H, K, K).to(ssm_state.dtype)
        qsl = meta.query_start_loc
        for r, slot in enumerate(meta.state_indices):
            s, e = qsl[r], qsl[r + 1]
            if e == s or r in meta.decode_rows:
                continue
            fresh = not meta.has_initial_state[r]
            conv_out, conv_state[slot] = causal_conv1d(
                mixed_qkv[s:e], layer.conv_weight, None if fresh else conv_state[slot])
            q, k, v = _qkv(conv_out, mixed_qkv.dtype, H, K)
            state = torch.zeros_like(ssm_state[slot], dtype=torch.float32) if fresh else ssm_state[slot]
            kda = kda_chunked if meta.is_prefilling[r] else kda_recurrent
            core[s:e], final = kda(q, k, v, g[s:e], beta[s:e], state)
            ssm_state[slot] = final.to(ssm_state.dtype)
        gate = output_gate.unflatten(-1, (H, K))
        return layer.o_norm(core.to(mixed_qkv.dtype), gate).flatten(-2)


def _qkv(conv_out: torch.Tensor, act_dtype: torch.dtype, H: int, K: int):
    """SiLU, then q, k, v [.., H, K] in float32 with q and k l2-normalised (q also scaled by K^-1/2)."""
    # Round like the activations a kernel would store, so that bf16 runs match kernels.
    qkv = torch.nn.functional.silu(conv_out).to(act_dtype).float()
    q, k, v = (x.unflatten(-1, (H, K)) for x in qkv.chunk(3, dim=-1))
    return l2norm(q) * K ** -0.5, l2norm(k), v
