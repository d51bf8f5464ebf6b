"""Shared fixtures: tiny checkpoints written to tmp dirs, and skipping of GPU tests without CUDA."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Our own Triton kernels run on the CPU through Triton's interpreter (fla-core's cannot: GPU tests only).
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    import triton_interpreter_fixes
    triton_interpreter_fixes.apply()

from vllm.tools.make_tiny_model import write_tiny_model


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        # fp32 comparisons against references must not silently run in TF32.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tiny_k3(tmp_path) -> str:
    return write_tiny_model(tmp_path / "k3", "k3")


@pytest.fixture
def tiny_kimi_linear(tmp_path) -> str:
    return write_tiny_model(tmp_path / "kl", "kimi_linear")
