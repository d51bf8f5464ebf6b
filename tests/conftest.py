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


# The interpreter-bound files take about half of the CPU suite: under pytest-xdist (`-n 2 --dist loadfile`, one
# file per worker) they go first, the longest first (150-700 s each on the 2-core CI machine), so that the other
# worker takes the many short files meanwhile instead of one worker ending the run alone on a long one. Every
# worker orders alike, as xdist requires.
LONGEST = ("tests/worker/test_device_trim.py", "tests/worker/test_graph_replay.py",
           "tests/worker/test_dspark_graphs.py", "tests/worker/test_piecewise.py")
FIRST = ("tests/worker/",)
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One process per core: a worker's torch with every core's thread would oversubscribe the machine.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        def rank(item) -> int:
            path = item.nodeid.split("::", 1)[0]
            return LONGEST.index(path) if path in LONGEST else len(LONGEST) + (not path.startswith(FIRST))
        items.sort(key=rank)  # stable: the order within a rank is the collection's
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
