"""The MLA (multi-head latent attention) mixer, NoPE, with an optional sigmoid output gate (K3)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm.distributed.communication_op import tensor_model_parallel_all_reduce
from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import merge_linear_weights
from vllm.transformers_utils.configs.kimi_k3 import KimiK3TextConfig


class KimiMLAAttention(nn.Module):
    def __init__(self, config: KimiK3TextConfig, layer_idx: int, backend: Any) -> None:
        super().__init__()
        # Split by head over the tensor-parallel ranks (q, kv_b, gate, o_proj); the latent projection and its
        # norm are replicated, so every rank keeps the whole latent cache.
        D, H = config.hidden_size, config.num_attention_heads // get_tensor_model_parallel_world_size()
        self.layer_idx, self.num_heads = layer_idx, H
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim, self.qk_head_dim = config.qk_nope_head_dim, config.qk_head_dim
        self.v_head_dim = config.v_head_dim
        self.scale = config.qk_head_dim ** -0.5
        self.backend = backend
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * config.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=config.latent_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, H * config.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, config.mla_cache_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, eps=config.latent_norm_eps)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, H * (config.qk_nope_head_dim + config.v_head_dim),
                                   bias=False)
        if config.mla_use_output_gate:
            self.g_proj = nn.Linear(D, H * config.v_head_dim, bias=False)
        self.o_proj = nn.Linear(H * config.v_head_dim, D, bias=False)
        self.kv_cache: torch.Tensor | None = None  # bound by the engine: [blocks, block_size, L + R]
        self.in_proj_weight: torch.Tensor | None = None  # q (or q_a) and kv_a as one GEMM, set after loading
        self.in_proj_split: list[int] = []

    def process_weights_after_loading(self) -> None:
        # One GEMM where there were two: q (q_a with a q LoRA) and the latent's kv_a both read x.
        first = self.q_proj if hasattr(self, "q_proj") else self.q_a_proj
        self.in_proj_weight = merge_linear_weights(first, self.kv_a_proj_with_mqa, pad_to=8)
        widths = [first.out_features, self.kv_lora_rank, self.mla_rope_dim]
        self.in_proj_split = widths + [self.in_proj_weight.shape[0] - sum(widths)]  # the last: alignment padding

    # In three parts as KDA's mixer is (piecewise CUDA graphs): forward = output(attend(project(x)), x).
    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q [T, H, qk_head_dim], latent [T, kv_lora_rank + rope dim]), the core's inputs."""
        assert self.in_proj_weight is not None, "KimiMLAAttention.process_weights_after_loading() was not run"
        q, c_kv, k_r, _ = nn.functional.linear(x, self.in_proj_weight).split(self.in_proj_split, -1)
        if not hasattr(self, "q_proj"):
            q = self.q_b_proj(self.q_a_layernorm(q))
        return q.unflatten(-1, (self.num_heads, self.qk_head_dim)), torch.cat([self.kv_a_layernorm(c_kv), k_r], dim=-1)

    def attend(self, inputs: tuple[torch.Tensor, ...], attn_metadata: Any) -> torch.Tensor:
        assert self.kv_cache is not None, "MLA latent cache is not bound"
        q, latent = inputs
        return self.backend.forward(q, latent, self.kv_cache, self.kv_b_proj.weight, self.qk_nope_head_dim,
                                    self.v_head_dim, self.scale, attn_metadata)

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "g_proj"):
            # The K3 gate reads the mixer's input, not the attention output.
            o = o * torch.sigmoid(self.g_proj(x).float()).unflatten(-1, (self.num_heads, -1)).to(o.dtype)
        return tensor_model_parallel_all_reduce(self.o_proj(o.flatten(-2)))

    def forward(self, x: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        return self.output(self.attend(self.project(x), attn_metadata), x)

    @property
    def mla_rope_dim(self) -> int:
        return self.qk_head_dim - self.qk_nope_head_dim
