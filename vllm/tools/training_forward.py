"""A differentiable full-sequence forward of the engine's KimiK3ForCausalLM, for training the built-in model.

The engine's forward runs over paged caches and state pools under inference mode, with Triton kernels (fused
norms, fused MoE, merged projection weights) that have no backward. This forward reads the same parameters
(so a trained state_dict is a checkpoint the engine loads) over a [B, T] batch of whole sequences:

- MLA unabsorbed: k = [kv_b(c_kv) nope part, k_r], v from kv_b, causal SDPA at the engine's scale (NoPE);
- KDA: depthwise causal conv + SiLU, then on CUDA fla-core's `chunk_kda` with its backward and the gate,
  l2norm and beta sigmoid in-kernel (the flags the engine's `triton` backend passes), on the CPU our torch
  chunked form (`vllm.attention.kda.ops`, differentiable);
- MoE: the router's torch form and one expert at a time (`KimiMoE._routed_by_expert`), which also counts each
  expert's tokens for the load-balancing bias update.

tests/tools/test_training_forward.py holds it to the engine's logits on the same weights.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from vllm.attention.kda.ops import kda_chunked, kda_gate, l2norm
from vllm.model_executor.models.kimi_k3.attn_res import attn_res_mix, attn_res_stack
from vllm.model_executor.models.kimi_k3.kda import KimiDeltaAttention
from vllm.model_executor.models.kimi_k3.mla import KimiMLAAttention
from vllm.model_executor.models.kimi_k3.model import KimiDecoderLayer, KimiK3ForCausalLM
from vllm.model_executor.models.kimi_k3.moe import KimiMLP, KimiMoE


def mla_forward(attn: KimiMLAAttention, x: torch.Tensor) -> torch.Tensor:
    """x [B, T, D] -> [B, T, D], causal within each sequence."""
    H = attn.num_heads
    if hasattr(attn, "q_proj"):
        q = attn.q_proj(x)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm.forward_native(attn.q_a_proj(x)))
    q = q.unflatten(-1, (H, attn.qk_head_dim))
    c_kv, k_r = attn.kv_a_proj_with_mqa(x).split([attn.kv_lora_rank, attn.mla_rope_dim], dim=-1)
    kv = attn.kv_b_proj(attn.kv_a_layernorm.forward_native(c_kv)).unflatten(-1, (H, -1))
    k_nope, v = kv.split([attn.qk_nope_head_dim, attn.v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_r[:, :, None, :].expand(-1, -1, H, -1).to(k_nope.dtype)], dim=-1)
    q, k, v = (t.transpose(1, 2) for t in (q, k.to(q.dtype), v.to(q.dtype)))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)
    return attn.output(o.transpose(1, 2), x)


def kda_forward(attn: KimiDeltaAttention, x: torch.Tensor) -> torch.Tensor:
    """x [B, T, D] -> [B, T, D], each sequence from a zero state."""
    B, T, _ = x.shape
    H, K = attn.num_heads, attn.head_dim
    mixed = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)  # [B, T, 3P]
    weight = torch.cat([attn.q_conv1d.weight, attn.k_conv1d.weight, attn.v_conv1d.weight])  # [3P, W]
    width = weight.shape[1]
    conv = F.conv1d(F.pad(mixed.transpose(1, 2), (width - 1, 0)), weight[:, None, :].to(mixed.dtype),
                    groups=weight.shape[0])
    q, k, v = (t.unflatten(-1, (H, K)) for t in F.silu(conv).transpose(1, 2).chunk(3, dim=-1))
    raw_gate = attn.f_b_proj(attn.f_a_proj(x))
    raw_beta = attn.b_proj(x)
    output_gate = attn.g_proj(x) if hasattr(attn, "g_proj") else attn.g_b_proj(attn.g_a_proj(x))
    if x.is_cuda:
        from fla.ops.kda import chunk_kda
        core, _ = chunk_kda(q, k, v, raw_gate.unflatten(-1, (H, K)), raw_beta, scale=K ** -0.5,
                            A_log=attn.A_log, dt_bias=attn.dt_bias, use_qk_l2norm_in_kernel=True,
                            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                            lower_bound=attn.gate_lower_bound, safe_gate=attn.gate_lower_bound is not None)
    else:
        g = kda_gate(raw_gate, attn.A_log, attn.dt_bias, K, attn.gate_lower_bound)
        beta = torch.sigmoid(raw_beta.float())
        zero = q.new_zeros(H, K, K, dtype=torch.float32)
        core = torch.stack([kda_chunked(l2norm(q[b]) * K ** -0.5, l2norm(k[b]), v[b].float(), g[b], beta[b], zero)[0]
                            for b in range(B)])
    y = attn.o_norm(core.to(x.dtype), output_gate.unflatten(-1, (H, K))).flatten(-2)
    return attn.o_proj(y)


def mlp_forward(mlp: KimiMLP, x: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(mlp.act(mlp.gate_proj(x), mlp.up_proj(x)))


def moe_forward(moe: KimiMoE, x: torch.Tensor, expert_counts: list[torch.Tensor] | None) -> torch.Tensor:
    """x [B, T, D]; appends the layer's tokens per expert [E] to `expert_counts` when given."""
    flat = x.flatten(0, 1)
    weights, ids = moe.gate.forward_native(flat.float() @ moe.gate.weight.float().t())
    if expert_counts is not None:
        expert_counts.append(torch.bincount(ids.flatten(), minlength=len(moe.experts)))
    latent = hasattr(moe, "routed_expert_down_proj")
    u = moe.routed_expert_down_proj(flat) if latent else flat
    y = moe._routed_by_expert(u, weights, ids).to(flat.dtype)
    if latent:
        if hasattr(moe, "routed_expert_norm"):
            y = moe.routed_expert_norm.forward_native(y)
        y = moe.routed_expert_up_proj(y)
    if hasattr(moe, "shared_experts"):
        y = y + mlp_forward(moe.shared_experts, flat)
    return y.view_as(x)


def layer_attention(layer: KimiDecoderLayer, x: torch.Tensor) -> torch.Tensor:
    x = layer.input_layernorm.forward_native(x)
    return kda_forward(layer.self_attn, x) if layer.is_kda else mla_forward(layer.self_attn, x)


def layer_feed_forward(layer: KimiDecoderLayer, x: torch.Tensor,
                       expert_counts: list[torch.Tensor] | None = None) -> torch.Tensor:
    x = layer.post_attention_layernorm.forward_native(x)
    if hasattr(layer, "block_sparse_moe"):
        return moe_forward(layer.block_sparse_moe, x, expert_counts)
    return mlp_forward(layer.mlp, x)


def training_logits(model: KimiK3ForCausalLM, input_ids: torch.Tensor,
                    expert_counts: list[torch.Tensor] | None = None,
                    layer_output: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
    """Logits [B, T, vocab] of every position of input_ids [B, T]. `layer_output(l, h)`, when given, sees the
    stream after each layer l (as KimiK3Model.capture_hidden_states records it: DSpark's context)."""
    m, cfg = model.model, model.config
    h = m.embed_tokens(input_ids)

    def ffn(layer, x):
        return layer_feed_forward(layer, x, expert_counts)

    if cfg.attn_res_block_size is not None:
        sources = attn_res_stack(m.layers, h, cfg.attn_res_block_size, attention=layer_attention, feed_forward=ffn,
                                 layer_output=layer_output)
        h = attn_res_mix(sources, m.output_attn_res_norm.weight, m.output_attn_res_proj.weight, cfg.rms_norm_eps)
    else:
        for i, layer in enumerate(m.layers):
            h = h + layer_attention(layer, h)
            h = h + ffn(layer, h)
            if layer_output is not None:
                layer_output(i, h)
    weight = m.embed_tokens.weight if cfg.tie_word_embeddings else model.lm_head.weight
    return m.norm.forward_native(h) @ weight.t().to(h.dtype)
