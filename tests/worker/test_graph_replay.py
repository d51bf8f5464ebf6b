"""The runner's CUDA graph path, checked on a CPU by replaying the way a graph does.

A captured graph reruns its kernels on fixed buffers with the host decisions of its capture. `ReplayByRerun`
stands in for `CUDAGraphRunner`: replay reruns the captured function, whose metadata holds frozen copies of
the capture's host values and views of the persistent device buffers (the contract `InputBatch.graph_metadata`
keeps). So a step that read anything not refilled in place, or relied on host values of its own, would diverge
from eager. The graph-capable kernels (native KDA decode, TRITON_MLA) run in Triton's interpreter; on a GPU the
same test uses real graphs.
"""
from __future__ import annotations

import pytest
import torch
from spec_helpers import ScriptedProposer

from vllm import LLM, SamplingParams
from vllm.assets import DEFAULT_MODEL_DIR
from vllm.attention.kda.native import NativeKDABackend
from vllm.attention.mla.triton_mla import TritonMLABackend
from vllm.config import CompilationConfig
from vllm.tools.make_tiny_model import tiny_text_config, write_tiny_model
from vllm.worker import model_runner
from vllm.worker.cudagraph import CUDAGraphMode

GRAPH_BACKENDS = dict(attention_backend="TRITON_MLA", kda_prefill_backend="torch", kda_decode_backend="native")


class ReplayByRerun:
    """CUDAGraphRunner's interface; `replay` reruns what `capture` was given and counts what it replayed."""

    def __init__(self, device) -> None:
        self.fns, self.replayed = {}, []

    def capture(self, desc, fn, warmup: int = 1) -> None:
        fn()
        self.fns[desc] = fn

    def __contains__(self, desc) -> bool:
        return desc in self.fns

    def replay(self, desc):
        self.replayed.append(desc)
        return self.fns[desc]()


@pytest.fixture
def graph_capable_on_cpu(monkeypatch):
    """Lets the Triton kernels run in the interpreter and the graph path run off CUDA."""
    if torch.cuda.is_available():
        return
    pytest.importorskip("triton")
    monkeypatch.setattr(TritonMLABackend, "supports", classmethod(lambda cls, *a, **k: None))
    monkeypatch.setattr(NativeKDABackend, "supports", classmethod(lambda cls, *a, **k: None))
    monkeypatch.setattr(CompilationConfig, "resolved_mode",
                        lambda self, device: "NONE" if self.enforce_eager else (self.cudagraph_mode or "NONE"))
    monkeypatch.setattr(model_runner, "CUDAGraphRunner", ReplayByRerun)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    lac = dict(tiny_text_config("k3")["linear_attn_config"], head_dim=32)  # power-of-two KDA head dim
    return write_tiny_model(tmp_path_factory.mktemp("k3"), "k3", qk_rope_head_dim=16, linear_attn_config=lac)


def _generate(model_dir, batch, params, reference=None, **kwargs):
    llm = LLM(model=model_dir, tokenizer=str(DEFAULT_MODEL_DIR), dtype="float32", max_model_len=128,
              max_num_batched_tokens=32, max_num_seqs=4, **GRAPH_BACKENDS, **kwargs)
    if reference is not None:  # drafts right and wrong by design, so verify rows of 0..K drafts replay
        K = llm.llm_engine.num_spec
        llm.llm_engine.proposer = ScriptedProposer(reference, K, llm.llm_engine.vocab_size)
    outs = llm.generate(batch, params, use_tqdm=False)
    llm.llm_engine.kv_cache_manager.assert_all_free()
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("K", [0, 2])
def test_graph_replay_equals_eager(graph_capable_on_cpu, model_dir, K):
    gen = torch.Generator().manual_seed(K)
    # Three requests on graphs of up to 4 requests: every replay pads zero-length rows and no-op tokens.
    batch = [{"prompt_token_ids": torch.randint(5, 250, (n,), generator=gen).tolist()} for n in (9, 3, 20)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": K} if K else None
    _, eager = _generate(model_dir, batch, params, enforce_eager=True)
    reference = {tuple(p["prompt_token_ids"]): out for p, out in zip(batch, eager)} if K else None
    llm, graphed = _generate(model_dir, batch, params, reference, speculative_config=spec,
                             compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY",
                                                 "cudagraph_capture_sizes": [4, 12]})
    runner = llm.llm_engine.runner
    assert runner.cudagraph_mode is CUDAGraphMode.FULL_DECODE_ONLY
    assert graphed == eager
    replayed = runner.graphs.replayed
    assert replayed, "decode steps were meant to replay graphs"
    assert all(d.max_query_len == 1 + K for d in replayed), "only bounded decode/verify graphs replay"
    assert any(d.num_reqs > 3 for d in replayed), "three requests on 4-request graphs: padding rows replayed"
    if K:
        assert llm.llm_engine.spec_decode_stats.num_accepted_tokens > 0, "verify rows kept drafts in graphs"
