"""Small helpers (vllm/utils.py): async_tensor_h2d / async_tensor_d2h copy, never view, the caller's data (lists and numpy
alike); prefer_blas_for_rows picks the BLAS library by GEMM rows."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.utils import async_tensor_d2h, async_tensor_h2d

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_h2d_copies_lists_and_numpy_arrays(device):
    data = np.random.default_rng(0).integers(0, 1000, size=(3, 5))
    t = async_tensor_h2d(data, torch.int64, device)
    data[0, 0] = -1  # the caller reuses its buffer at once
    assert t.device.type == device and t.dtype == torch.int64
    assert t.cpu()[0, 0] != -1 and torch.equal(t.cpu()[1:], torch.from_numpy(data[1:]))
    floats = async_tensor_h2d([[0.5, 1.0], [2.0, 3.5]], torch.float32, device)
    assert torch.equal(floats.cpu(), torch.tensor([[0.5, 1.0], [2.0, 3.5]]))


@pytest.mark.parametrize("device", DEVICES)
def test_d2h_returns_the_values_once_the_stream_has_run(device):
    x = torch.randn(64, device=device)
    host = async_tensor_d2h(x * 2)
    if device == "cuda":
        assert host.is_pinned()
        torch.cuda.current_stream().synchronize()
    assert host.device.type == "cpu" and torch.equal(host, (x * 2).cpu())


def test_fp32_gemms_on_cuda_take_the_blas_library_that_is_fast_at_their_rows(monkeypatch):
    """cuBLASLt up to 16 rows, cuBLAS above (the bench_small_gemm.py figures in vllm/utils.py); set only when the
    choice changes, and never for other dtypes or off CUDA."""
    from vllm import utils
    calls = []
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", calls.append)
    monkeypatch.setattr(utils, "_preferred_blas", [])
    cuda = torch.device("cuda")
    for rows in (1, 16, 17, 64, 4):
        utils.prefer_blas_for_rows(rows, torch.float32, cuda)
    assert calls == ["cublaslt", "cublas", "cublaslt"]
    utils.prefer_blas_for_rows(32, torch.bfloat16, cuda)
    utils.prefer_blas_for_rows(32, torch.float32, torch.device("cpu"))
    assert calls == ["cublaslt", "cublas", "cublaslt"]
