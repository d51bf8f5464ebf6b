"""The MoE's graph-capturable routing (every expert on every token, keep the chosen) equals the grouped one."""
from __future__ import annotations

import torch

from vllm.model_executor.models.kimi_k3.config import KimiK3TextConfig
from vllm.model_executor.models.kimi_k3.moe import KimiMoE
from vllm.tools.make_tiny_model import tiny_text_config


def test_every_expert_routing_equals_grouped_routing():
    torch.manual_seed(0)
    moe = KimiMoE(KimiK3TextConfig.from_dict(tiny_text_config("k3"))).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    moe.process_weights_after_loading()
    assert moe.experts[1].w3.weight.data_ptr() == moe.w13[1, moe.w13.shape[1] // 2:].data_ptr(), \
        "the experts' parameters are views into the stacked weights, not copies"
    x = torch.randn(11, moe.gate.weight.shape[1], dtype=torch.float64)
    weights, ids = moe.gate(x)
    assert len(set(ids.flatten().tolist())) > 1, "the routing must spread over several experts"
    u = moe.routed_expert_down_proj(x) if hasattr(moe, "routed_expert_down_proj") else x  # K3's latent MoE
    grouped = moe._routed_by_expert(u, weights, ids)
    every = moe._routed_every_expert(u, weights, ids)
    torch.testing.assert_close(every, grouped, rtol=1e-12, atol=1e-12)
    # A token's output changes when its routing does: the check above is not comparing two zero tensors.
    assert grouped.abs().min() > 0
