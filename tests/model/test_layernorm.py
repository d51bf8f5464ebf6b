"""The Triton RMSNorm (with and without the fused residual add) against the torch form, and the merged
projection weights against the separate ones. The kernel runs through Triton's interpreter on the CPU."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import merge_linear_weights, stack_linear_weights

layernorm_kernels = pytest.importorskip("vllm.model_executor.layers.layernorm_kernels")

DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                        reason="CPU tensors run through the Triton interpreter")),
           pytest.param("cuda", marks=pytest.mark.gpu)]


def _norm(D: int, dtype: torch.dtype, device: str, gen: torch.Generator) -> RMSNorm:
    norm = RMSNorm(D, eps=1e-6)
    norm.weight.data = (1 + 0.5 * torch.randn(D, generator=gen)).to(device=device, dtype=dtype)
    return norm


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 200, 2048])
def test_rms_norm_matches_torch(device, dtype, D):
    gen = torch.Generator().manual_seed(D)
    norm = _norm(D, dtype, device, gen)
    x = (3 * torch.randn(7, D, generator=gen)).to(device=device, dtype=dtype)
    got = layernorm_kernels.rms_norm(x, norm.weight, norm.eps)
    want = norm.forward_native(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    # Only the order of the fp32 sum of squares differs: at most one rounding step of the output dtype.
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(got, want, rtol=2 * ulp, atol=2 * ulp * want.abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_residual_add(device, dtype):
    gen = torch.Generator().manual_seed(1)
    D = 96
    norm = _norm(D, dtype, device, gen)
    x, residual = (torch.randn(2, 5, D, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    got, got_sum = layernorm_kernels.rms_norm(x, norm.weight, norm.eps, residual)
    want_sum = x + residual
    ulp = torch.finfo(dtype).eps
    if device == "cuda" or dtype == torch.float32:
        assert torch.equal(got_sum, want_sum), "the residual stream is rounded exactly as torch's add"
    else:  # the interpreter's fp32 -> bf16 casts truncate where GPUs round to nearest
        torch.testing.assert_close(got_sum, want_sum, rtol=ulp, atol=0)
    want = norm.forward_native(want_sum)
    torch.testing.assert_close(got, want, rtol=2 * ulp, atol=2 * ulp * want.abs().max().item())
    # The torch path of the module gives the same pair (what CPU steps run).
    cpu_norm, cpu_sum = norm.cpu()(x.cpu(), residual.cpu())
    assert torch.equal(cpu_sum, want_sum.cpu())


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors run through the Triton interpreter")
def test_strided_rows_and_empty_input():
    """A split view (MLA's latent half) is read through its row stride; zero rows launch nothing."""
    gen = torch.Generator().manual_seed(2)
    norm = _norm(48, torch.float32, "cpu", gen)
    packed = torch.randn(6, 64, generator=gen)
    view = packed[:, :48]
    torch.testing.assert_close(layernorm_kernels.rms_norm(view, norm.weight, norm.eps),
                               norm.forward_native(view.contiguous()))
    assert layernorm_kernels.rms_norm(packed[:0, :48], norm.weight, norm.eps).shape == (0, 48)
    with pytest.raises(ValueError, match="contiguous last dim"):
        layernorm_kernels.rms_norm(packed.t()[:, :48], norm.weight, norm.eps)


def test_merged_weights_are_views_and_give_the_same_outputs():
    gen = torch.Generator().manual_seed(3)
    layers = [nn.Linear(16, n, bias=False) for n in (8, 5, 3)]
    for layer in layers:
        layer.weight.data = torch.randn(layer.weight.shape, generator=gen)
    x = torch.randn(4, 16, generator=gen)
    want = [layer(x) for layer in layers]
    merged = merge_linear_weights(*layers)
    assert merged.shape == (16, 16)
    got = nn.functional.linear(x, merged).split([8, 5, 3], dim=-1)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    layers[1].weight.data.zero_()  # a view: writing through the checkpoint name writes the merged weight
    assert not merged[8:13].any() and merged[:8].abs().sum() > 0
    with pytest.raises(ValueError, match="bias-free"):
        merge_linear_weights(nn.Linear(4, 4))


def test_merged_weights_pad_to_aligned_rows():
    """pad_to adds zero rows after the last layer's, so every column slice of the output keeps aligned rows."""
    gen = torch.Generator().manual_seed(4)
    layers = [nn.Linear(8, n, bias=False) for n in (6, 3)]
    for layer in layers:
        layer.weight.data = torch.randn(layer.weight.shape, generator=gen)
    x = torch.randn(5, 8, generator=gen)
    want = [layer(x) for layer in layers]
    merged = merge_linear_weights(*layers, pad_to=8)
    assert merged.shape == (16, 8) and not merged[9:].any()
    out = nn.functional.linear(x, merged)
    assert out.stride(0) % 8 == 0
    for g, w in zip(out.split([6, 3, 7], dim=-1), want):
        torch.testing.assert_close(g, w)
    assert merge_linear_weights(nn.Linear(8, 8, bias=False), pad_to=8).shape == (8, 8), "aligned: no padding"


def test_stacked_weights_are_views_for_one_batched_gemm():
    gen = torch.Generator().manual_seed(5)
    layers = [nn.Linear(4, 6, bias=False) for _ in range(2)]
    for layer in layers:
        layer.weight.data = torch.randn(layer.weight.shape, generator=gen)
    x = torch.randn(3, 8, generator=gen)
    want = [layers[0](x[:, :4]), layers[1](x[:, 4:])]
    stacked = stack_linear_weights(*layers)
    got = torch.bmm(x.unflatten(-1, (2, 4)).transpose(0, 1), stacked.transpose(1, 2))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    layers[1].weight.data.zero_()
    assert not stacked[1].any() and stacked[0].abs().sum() > 0
    with pytest.raises(ValueError, match="one shape"):
        stack_linear_weights(nn.Linear(4, 4, bias=False), nn.Linear(4, 5, bias=False))
