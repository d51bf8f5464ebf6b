"""Shared by the worker tests: the graph-capable kernels (native KDA decode, TRITON_MLA) on a CPU, in Triton's
interpreter, with a stand-in for CUDA graph capture that refuses host syncs (tests/graph_standin.py)."""
from __future__ import annotations

import pytest
import torch
from graph_standin import ReplayByRerun

from vllm.attention.kda.native import NativeKDABackend
from vllm.attention.mla.triton_mla import TritonMLABackend
from vllm.config import CompilationConfig
from vllm.tools.make_tiny_model import tiny_text_config, write_tiny_model
from vllm.worker import graphs

GRAPH_BACKENDS = dict(attention_backend="TRITON_MLA", kda_prefill_backend="torch", kda_decode_backend="native")


@pytest.fixture
def graph_backends(monkeypatch) -> dict:
    """The graph-capable backend flags; off CUDA, lets their Triton kernels run in the interpreter and the
    graph path run with ReplayByRerun standing in for capture."""
    if torch.cuda.is_available():
        return GRAPH_BACKENDS
    pytest.importorskip("triton")
    monkeypatch.setattr(TritonMLABackend, "supports", classmethod(lambda cls, *a, **k: None))
    monkeypatch.setattr(NativeKDABackend, "supports", classmethod(lambda cls, *a, **k: None))
    monkeypatch.setattr(CompilationConfig, "resolved_mode",
                        lambda self, device: "NONE" if self.enforce_eager else (self.cudagraph_mode or "NONE"))
    monkeypatch.setattr(graphs, "CUDAGraphRunner", ReplayByRerun)
    return GRAPH_BACKENDS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    lac = dict(tiny_text_config("k3")["linear_attn_config"], head_dim=32)  # power-of-two KDA head dim
    return write_tiny_model(tmp_path_factory.mktemp("k3"), "k3", qk_rope_head_dim=16, linear_attn_config=lac)
