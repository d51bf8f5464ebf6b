"""Block Attention-Residuals (K3): each sublayer reads a softmax mixture of block snapshots.

For sources x_i (earlier block sums and the running partial sum P), the score of x_i is
(w_norm * w_proj) . x_i / rms(x_i); the mixture sums the *unnormalised* sources with softmax(scores).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from vllm.model_executor.layers.layernorm import rms_normalize


def attn_res_mix(sources: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """sources: N tensors [T, D]; norm_weight [D]; proj_weight [1, D]. Returns the mixture [T, D]."""
    if len(sources) == 1:
        return sources[0]
    x = torch.stack(sources).float()  # [N, T, D]
    w = norm_weight.float() * proj_weight.float().view(-1)
    alpha = (rms_normalize(x, eps) @ w).softmax(dim=0)  # [N, T]
    return (alpha[..., None] * x).sum(0).to(sources[0].dtype)


def attn_res_stack(layers: Sequence[nn.Module], emb: torch.Tensor, block_size: int,
                   attention: Callable[[nn.Module, torch.Tensor], torch.Tensor],
                   feed_forward: Callable[[nn.Module, torch.Tensor], torch.Tensor],
                   layer_output: Callable[[int, torch.Tensor], None] | None = None) -> list[torch.Tensor]:
    """Block AttnRes over a layer stack; returns the sources the output mixture reads.

    `attention(layer, x)` and `feed_forward(layer, x)` run a layer's two sublayers, norms included (the engine
    passes its cached forward, the trainer a differentiable one). The running partial-block sum P and snapshots
    (snapshots[b] is the stream at block b's start, snapshots[0] the embedding) follow the layers; layer l opens
    a new block when l % block_size == 0. `layer_output(l, s)`, when given, sees the running sum s after layer l.
    """
    partial, snapshots, delta = emb, [], None
    for idx, layer in enumerate(layers):
        eps = layer.self_attention_res_norm.eps
        opens_block = idx % block_size == 0
        if delta is not None:
            partial = partial + delta
        if opens_block:
            snapshots.append(partial)
        n_attn = len(snapshots) - 1 if opens_block else len(snapshots)
        x = attn_res_mix(snapshots[:n_attn] + [partial], layer.self_attention_res_norm.weight,
                         layer.self_attention_res_proj.weight, eps)
        a = attention(layer, x)
        partial = a if opens_block else partial + a
        x = attn_res_mix(snapshots + [partial], layer.mlp_res_norm.weight, layer.mlp_res_proj.weight, eps)
        delta = feed_forward(layer, x)
        if layer_output is not None:
            layer_output(idx, partial + delta)
    return snapshots + [partial + delta]
