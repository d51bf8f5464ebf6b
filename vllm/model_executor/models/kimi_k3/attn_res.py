"""Block Attention-Residuals (K3): each sublayer reads a softmax mixture of block snapshots.

For sources x_i (earlier block sums and the running partial sum P), the score of x_i is
(w_norm * w_proj) . x_i / rms(x_i); the mixture sums the *unnormalised* sources with softmax(scores).
"""
from __future__ import annotations

import torch

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
