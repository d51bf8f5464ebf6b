"""The DSpark draft model (shared docs: dspark_and_adaptive.md): a block drafter over the target's hidden states.

Context: the target's hidden states at `target_layer_ids`, concatenated per token, go through `context_proj` and
`context_norm`; one fused projection (every layer's `kv_a_proj_with_mqa`, stacked) gives each draft layer's
latent [c_kv | k_rope], which is normalised (`kv_a_layernorm`), rotated at the token's position and written to
that layer's paged context cache. The draft layers never run over context tokens.

Query block: per request the anchor (its newest token) and K-1 mask tokens at the next K positions. Each layer
is MLA with q_lora and RoPE, attending to the request's context cache and, non-causally, to the whole block;
then a SiLU-GLU MLP. Position i predicts the token after it: logits from the target's lm_head on the final norm,
plus the Markov head's low-rank bias `markov_head.w2(markov_head.w1[prev_i])` (prev_0 the anchor, prev_i the
token drafted at i-1), drafted left to right. The confidence head, sigmoid of a float32 linear map of
[hidden_i ; markov_head.w1[prev_i]], estimates that draft i is accepted if the drafts before it were.

This is the torch form (eager, any device); the batch is padded to the longest context of the step. The same
modules train (vllm.tools.train_dspark): while gradients are on, norms take their torch form (`forward_native`;
the fused norm kernel has no backward), RoPE computes its angles and attention is SDPA. Serving (no gradients)
takes the fused norm (one launch where the torch form is six), a table of the angles' cos and sin
(`build_rope_table`, looked up once per call and shared by every rotation in it) and attention as two batched
matmuls around a softmax: a step is a few hundred launches of tiny kernels, so each one saved counts.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.activation import silu_and_mul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.transformers_utils.configs.dspark import DSparkConfig


def rope_angles(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [..., rotary_dim / 2] of the rotary angles at `positions`, in float32."""
    half = rotary_dim // 2
    inv_freq = theta ** (-torch.arange(half, device=positions.device, dtype=torch.float32) / half)
    angles = positions.float()[..., None] * inv_freq
    return angles.cos(), angles.sin()


def rope_factors(positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """[..., 2, rotary_dim] float32: the rotate-half form's factors at `positions`, [cos ; cos] and [-sin ; sin]
    (see rope)."""
    cos, sin = rope_angles(positions, rotary_dim, theta)
    return torch.stack([torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)], dim=-2)


def rope(x: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half form, over the last dim of x [..., R], with rope_factors at x's positions
    (broadcastable to x's leading shape): x * [cos ; cos] + [x2 ; x1] * [-sin ; sin], which is [x1 cos - x2 sin ;
    x2 cos + x1 sin] to the bit (products rounded, then summed)."""
    half = x.shape[-1] // 2
    xf = x.float()
    swapped = torch.cat([xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * factors[..., 0, :] + swapped * factors[..., 1, :]).to(x.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale where mask, else -inf) v for q [N, Q, H, d], k [N, S, H, d], v [N, S, H, dv] and mask
    [N, Q, S]; returns [N, Q, H, dv]. Training runs SDPA (its memory-efficient kernel keeps no [Q, S] scores per
    head); serving computes the scores: at a draft step's size (a few queries, a few hundred keys, float32) SDPA's
    kernel took 30 us per layer on the H200, longer than the few launches of the explicit form."""
    if torch.is_grad_enabled():
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=mask[:, None], scale=scale).transpose(1, 2)
    scores = torch.matmul(q.transpose(1, 2), k.permute(0, 2, 3, 1))  # [N, H, Q, S]
    scores = scores.mul_(scale).masked_fill_(~mask[:, None], float("-inf"))
    return torch.matmul(scores.softmax(-1), v.transpose(1, 2)).transpose(1, 2)


def _norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """The fused norm when nothing trains, else the torch form, which has a backward."""
    return norm.forward_native(x) if torch.is_grad_enabled() else norm(x)


class DSparkAttention(nn.Module):
    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        D, H = config.hidden_size, config.num_attention_heads
        self.config = config
        self.num_heads = H
        self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, H * (config.qk_nope_head_dim + config.qk_rope_head_dim),
                                  bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, config.mla_cache_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, H * (config.qk_nope_head_dim + config.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(H * config.v_head_dim, D, bias=False)
        self.kv_cache: torch.Tensor | None = None  # [num_blocks, block_size, mla_cache_dim], bound by the runner

    def latent(self, kv_a: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
        """The cached form of kv_a_proj_with_mqa's output [..., L + R]: normalised c_kv, k_rope rotated by the
        rope_factors of its positions."""
        c_kv, k_rope = kv_a.split([self.config.kv_lora_rank, self.config.qk_rope_head_dim], dim=-1)
        return torch.cat([_norm(self.kv_a_layernorm, c_kv), rope(k_rope, factors)], dim=-1)

    def forward(self, x: torch.Tensor, factors: torch.Tensor, context: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """x [N, Q, D] block tokens, with the rope_factors [N, Q, 2, R] of their positions, attend to the keys
        [context [N, C, L + R] latents ; the block's own Q] where mask [N, Q, C + Q] is true."""
        cfg, H = self.config, self.num_heads
        N, Q, _ = x.shape
        nope, r, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        q = self.q_b_proj(_norm(self.q_a_layernorm, self.q_a_proj(x))).view(N, Q, H, nope + r)
        q = torch.cat([q[..., :nope], rope(q[..., nope:], factors[:, :, None])], dim=-1)
        keys = torch.cat([context, self.latent(self.kv_a_proj_with_mqa(x), factors)], dim=1)  # [N, C+Q, L+R]
        c_kv, k_rope = keys.split([cfg.kv_lora_rank, r], dim=-1)
        k_nope, v = self.kv_b_proj(c_kv).view(N, -1, H, nope + vd).split([nope, vd], dim=-1)
        k = torch.cat([k_nope, k_rope[:, :, None, :].expand(-1, -1, H, -1)], dim=-1)
        return self.o_proj(attend(q, k, v, mask, 1 / math.sqrt(nope + r)).flatten(-2))


class DSparkMLP(nn.Module):
    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))


class DSparkLayer(nn.Module):
    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DSparkAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = DSparkMLP(config)


class MarkovHead(nn.Module):
    """The low-rank bias of the previous token on the next one's logits: w2(w1[prev])."""

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        self.w1 = nn.Embedding(config.vocab_size, config.markov_rank)
        self.w2 = nn.Linear(config.markov_rank, config.vocab_size, bias=False)


class DSparkDraftModel(nn.Module):
    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        self.config = config
        D = config.hidden_size
        self.context_proj = nn.Linear(len(config.target_layer_ids) * (config.target_hidden_size or D), D, bias=False)
        self.context_norm = RMSNorm(D, eps=config.rms_norm_eps)
        if config.mask_token_id is None:
            self.mask_embedding = nn.Parameter(torch.zeros(D))
        self.layers = nn.ModuleList(DSparkLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(D, eps=config.rms_norm_eps)
        self.markov_head = MarkovHead(config)
        if config.enable_confidence_head:
            self.confidence_head = nn.Linear(D + config.markov_rank, 1, bias=True)
        self.fused_kv_a_weight: torch.Tensor | None = None
        self.rope_table: torch.Tensor | None = None  # build_rope_table

    def rope_factors_at(self, positions: torch.Tensor) -> torch.Tensor:
        """rope_factors [..., 2, R] at `positions`: from the table when serving (one lookup per call, shared by
        the layers), else computed (training)."""
        cfg = self.config
        if self.rope_table is None or torch.is_grad_enabled():
            return rope_factors(positions, cfg.qk_rope_head_dim, cfg.rope_theta)
        # Clamped: a padding row's garbage position must not index out of the table (a device-side assert).
        return self.rope_table[positions.clamp(0, self.rope_table.shape[0] - 1)]

    def process_weights_after_loading(self) -> None:
        """The context path's one projection for all layers: their kv_a_proj_with_mqa weights, stacked. The
        confidence head stays float32 (it is trained and read as a probability)."""
        self.fused_kv_a_weight = torch.cat([layer.self_attn.kv_a_proj_with_mqa.weight for layer in self.layers])
        if hasattr(self, "confidence_head"):
            self.confidence_head.float()

    def build_rope_table(self, num_positions: int, device: torch.device) -> None:
        """rope_factors at positions 0..num_positions-1, which serving reads instead of computing them at every
        call (the same values: the angles are elementwise in the position)."""
        cfg = self.config
        self.rope_table = rope_factors(torch.arange(num_positions, device=device), cfg.qk_rope_head_dim,
                                       cfg.rope_theta)

    def bind_caches(self, caches: list[torch.Tensor]) -> None:
        """One [num_blocks, block_size, L + R] cache per layer; its last slot is scratch for padding rows, so the
        last block must be one the block tables never hand out."""
        for layer, cache in zip(self.layers, caches, strict=True):
            layer.self_attn.kv_cache = cache

    def context_latents(self, target_hidden: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """Each layer's cached latents [..., L + R] of context tokens [..., n_layers * D_target] at positions."""
        c = _norm(self.context_norm, self.context_proj(target_hidden))
        parts = F.linear(c, self.fused_kv_a_weight).split(self.config.mla_cache_dim, dim=-1)
        factors = self.rope_factors_at(positions)
        return [layer.self_attn.latent(part, factors) for layer, part in zip(self.layers, parts)]

    def write_context(self, target_hidden: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Context tokens [T, n_layers * D_target] at positions [T] into every layer's cache at slot_mapping [T]
        (flat block * block_size + offset). Negative slots (padding) go to the cache's last slot, scratch that no
        block table reaches (bind_caches): a fixed-size write, where filtering them out would sync with the host."""
        for layer, latent in zip(self.layers, self.context_latents(target_hidden, positions)):
            cache = layer.self_attn.kv_cache.view(-1, self.config.mla_cache_dim)
            slots = torch.where(slot_mapping >= 0, slot_mapping, cache.shape[0] - 1)
            cache.index_copy_(0, slots.long(), latent.to(cache.dtype))

    def block_inputs(self, anchor_ids: torch.Tensor, num_tokens: int, embed: nn.Embedding) -> torch.Tensor:
        """[..., num_tokens, D]: the anchor's embedding, then the mask token's."""
        x = embed(anchor_ids)[..., None, :].expand(*anchor_ids.shape, num_tokens, -1).clone()
        if num_tokens > 1:
            cfg = self.config
            mask = embed.weight[cfg.mask_token_id] if cfg.mask_token_id is not None else self.mask_embedding
            x[..., 1:, :] = mask.to(x.dtype)
        return x

    def backbone(self, x: torch.Tensor, positions: torch.Tensor, contexts: list[torch.Tensor],
                 mask: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [N, Q, D] of block tokens x [N, Q, D]; contexts: each layer's [N, C, L + R]
        latents; mask [N, Q, C + Q] (see DSparkAttention.forward)."""
        factors = self.rope_factors_at(positions)
        for layer, context in zip(self.layers, contexts):
            x = x + layer.self_attn(_norm(layer.input_layernorm, x), factors, context.to(x.dtype), mask)
            x = x + layer.mlp(_norm(layer.post_attention_layernorm, x))
        return _norm(self.norm, x)

    def markov_logits(self, base: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Float32 logits: the lm_head's `base` plus the Markov bias of the previous tokens `prev`."""
        return base.float() + self.markov_head.w2(self.markov_head.w1(prev)).float()

    def confidence(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """P(draft accepted | the drafts before it were), from [h ; markov_head.w1[prev]] (float32)."""
        features = torch.cat([h, self.markov_head.w1(prev)], dim=-1).float()
        return torch.sigmoid(self.confidence_head(features)).squeeze(-1)

    def propose(self, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor, block_table: torch.Tensor,
                max_context: int, num_tokens: int, embed: nn.Embedding,
                lm_head_weight: torch.Tensor, with_confidence: bool = True, temperature: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Drafts [N, num_tokens], their confidences [N, num_tokens] (None without the head or when not asked
        for) and, with `temperature` [N] (probabilistic drafts), the distributions they were drawn from
        [N, num_tokens, V] float32: a row at temperature T > 0 samples softmax(logits / T), a row at 0 takes the
        argmax (its distribution row is then unused). Sampling is an exponential race over the device RNG, so it
        replays in a CUDA graph.

        Request n's anchor anchor_ids[n] sits at anchor_pos[n]; its context is positions [0, anchor_pos[n]) of
        the cache rows block_table[n]. max_context (host) bounds every anchor_pos, so nothing syncs."""
        N, K, cfg = anchor_ids.shape[0], num_tokens, self.config
        block_size = self.layers[0].self_attn.kv_cache.shape[1]
        ctx_pos = torch.arange(max_context, device=anchor_ids.device)
        valid = ctx_pos[None, :] < anchor_pos[:, None]  # [N, C]
        blocks = block_table[:, (ctx_pos // block_size).clamp(max=block_table.shape[1] - 1)]
        slots = (blocks.long() * block_size + ctx_pos % block_size).masked_fill(~valid, 0)
        positions = anchor_pos[:, None] + torch.arange(K, device=anchor_ids.device)  # [N, K]
        contexts = [layer.self_attn.kv_cache.view(-1, cfg.mla_cache_dim)[slots] for layer in self.layers]
        mask = torch.cat([valid[:, None, :].expand(N, K, -1), valid.new_ones(N, K, K)], dim=-1)  # block: whole
        h = self.backbone(self.block_inputs(anchor_ids, K, embed), positions, contexts, mask)
        base = h @ lm_head_weight.t()  # [N, K, V]
        tokens, prevs, probs = [], [], []
        prev = anchor_ids
        for i in range(K):  # left to right: position i's Markov bias depends on the token drafted at i-1
            prevs.append(prev)
            logits = self.markov_logits(base[:, i], prev)
            prev = logits.argmax(-1)
            if temperature is not None:
                q = torch.softmax(logits / temperature.clamp(min=1e-5)[:, None], dim=-1)
                sampled = (q / torch.empty_like(q).exponential_()).argmax(-1)
                prev = torch.where(temperature > 0, sampled, prev)
                probs.append(q)
            tokens.append(prev)
        confidence = None
        if with_confidence and hasattr(self, "confidence_head"):
            confidence = self.confidence(h, torch.stack(prevs, dim=1))
        return torch.stack(tokens, dim=1), confidence, torch.stack(probs, dim=1) if probs else None
