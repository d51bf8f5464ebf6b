"""The one-launch Triton gated RMSNorm equals the torch `gated_norm` on random rows, strided gates, odd head dims."""
from __future__ import annotations

import os

import pytest
import torch

from vllm.attention.kda.metadata import gated_norm
from vllm.model_executor.layers.layernorm import RMSNormGated

# Triton runs CPU tensors only in its interpreter (the CPU suite); on a GPU machine the cuda row covers the kernel.
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                        reason="CPU tensors run through the Triton interpreter")),
           pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("core_dtype,act_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                  (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("V", [32, 24], ids=["pow2", "odd"])
def test_fused_gated_norm_matches_torch(device, core_dtype, act_dtype, V):
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from vllm.attention.kda.norm import fused_gated_norm
    gen = torch.Generator().manual_seed(V)
    T, H = 37, 3
    norm = RMSNormGated(V, eps=1e-6)
    norm.weight.data = torch.randn(V, generator=gen)
    layer = SimpleNamespace(num_heads=H, o_norm=norm.to(device))
    core = (torch.randn(T, H, V, generator=gen) * 3).to(core_dtype).to(device)
    wide = torch.randn(T, 2 * H * V, generator=gen).to(act_dtype).to(device)
    gate = wide[:, 5:5 + H * V]  # a strided slice, as the layer's projections hand it over
    want = gated_norm(layer, core, gate, act_dtype)
    got = fused_gated_norm(layer, core, gate, act_dtype)
    assert got.dtype == act_dtype and got.shape == (T, H * V)
    tol = dict(rtol=1e-5, atol=1e-5) if act_dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
