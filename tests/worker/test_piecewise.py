"""Piecewise CUDA graphs (vllm/worker/piecewise.py), checked on a CPU the way test_graph_replay.py checks full
graphs: `ReplayByRerun` reruns each captured piece on the persistent buffers, refusing host reads. Greedy
outputs under PIECEWISE and FULL_AND_PIECEWISE equal eager ones through chunked prefills, mixed steps and
decodes, and the pieces really ran; AttnRes stacks, which have no forward in pieces, fall back."""
from __future__ import annotations

import pytest
import torch
from spec_helpers import ScriptedProposer

from vllm import LLM, SamplingParams
from vllm.assets import TINY_TOKENIZER_DIR
from vllm.attention.backend import AttentionCGSupport
from vllm.tools.make_tiny_model import tiny_text_config, write_tiny_model
from vllm.worker.cudagraph import CUDAGraphMode, resolve_mode
from vllm.worker.piecewise import PiecewiseCUDAGraphs, piecewise_sizes


@pytest.fixture(scope="module")
def plain_k3_dir(tmp_path_factory):
    """The K3 switches but AttnRes (whose forward is not in pieces)."""
    lac = dict(tiny_text_config("k3")["linear_attn_config"], head_dim=32)
    return write_tiny_model(tmp_path_factory.mktemp("k3_plain"), "k3", qk_rope_head_dim=16, linear_attn_config=lac,
                            attn_res_block_size=None)


def _generate(model_dir, batch, params, monkeypatch=None, reference=None, **kwargs):
    llm = LLM(model=model_dir, tokenizer=str(TINY_TOKENIZER_DIR), dtype="float32", max_model_len=128,
              max_num_batched_tokens=24, max_num_seqs=4, **kwargs)
    if reference is not None:  # drafts right and wrong by design: verify rows of 0..K accepted drafts
        K = llm.llm_engine.num_spec
        llm.llm_engine.runner.drafting.ngram = ScriptedProposer(reference, K, llm.llm_engine.vocab_size)
    runs = []
    if monkeypatch is not None:
        run = PiecewiseCUDAGraphs.run
        monkeypatch.setattr(PiecewiseCUDAGraphs, "run", lambda self, n, meta: runs.append(n) or run(self, n, meta))
    outs = llm.generate(batch, params, use_tqdm=False)
    llm.llm_engine.kv_cache_manager.assert_all_free()
    return llm, [o.outputs[0].token_ids for o in outs], runs


def test_piecewise_sizes():
    assert piecewise_sizes(8192) == [16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512]
    assert piecewise_sizes(100) == [16, 32, 64, 96, 100]
    assert piecewise_sizes(64) == [16, 32, 64]


def test_full_and_piecewise_lowers_to_piecewise_where_decode_graphs_cannot_replay():
    mode, reason = resolve_mode(CUDAGraphMode.FULL_AND_PIECEWISE, AttentionCGSupport.NEVER, 0)
    assert mode is CUDAGraphMode.PIECEWISE and "PIECEWISE" in reason
    assert resolve_mode(CUDAGraphMode.FULL_AND_PIECEWISE, AttentionCGSupport.ALWAYS, 2) == (
        CUDAGraphMode.FULL_AND_PIECEWISE, None)


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_AND_PIECEWISE"])
def test_piecewise_equals_eager(graph_backends, plain_k3_dir, monkeypatch, mode):
    gen = torch.Generator().manual_seed(3)
    # A 40-token prompt takes two chunks of the 24-token budget; the others join mid-way: mixed steps.
    batch = [{"prompt_token_ids": torch.randint(5, 250, (n,), generator=gen).tolist()} for n in (9, 40, 3, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    _, eager, _ = _generate(plain_k3_dir, batch, params, enforce_eager=True, **graph_backends)
    llm, graphed, runs = _generate(plain_k3_dir, batch, params, monkeypatch, **graph_backends,
                                   compilation_config={"cudagraph_mode": mode, "cudagraph_capture_sizes": [4]})
    runner = llm.llm_engine.runner
    assert runner.cudagraph_mode is CUDAGraphMode(mode)
    assert runner.graphs.piecewise.sizes == [16, 24]
    assert graphed == eager
    assert any(n > 16 for n in runs), runs  # the 24-token graphs, with padding rows at 23 tokens
    if mode == "PIECEWISE":
        assert any(n <= 4 for n in runs), "decode steps run in pieces when there are no full graphs"
    else:
        assert runs and all(n > 4 for n in runs), "a decode batch of <= 4 tokens has its full graph"


def test_piecewise_mixed_steps_with_verify_rows_equal_eager(graph_backends, plain_k3_dir, monkeypatch):
    """Speculation under FULL_AND_PIECEWISE: steps that mix prompt chunks with verify rows run in pieces, their
    KDA cores writing the verify rows' state checkpoints; greedy outputs stay the eager ones."""
    K = 2
    gen = torch.Generator().manual_seed(5)
    batch = [{"prompt_token_ids": torch.randint(5, 250, (n,), generator=gen).tolist()} for n in (9, 40, 3, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    _, eager, _ = _generate(plain_k3_dir, batch, params, enforce_eager=True, **graph_backends)
    reference = {tuple(p["prompt_token_ids"]): out for p, out in zip(batch, eager)}
    spec = {"method": "ngram", "num_speculative_tokens": K}
    llm, graphed, runs = _generate(plain_k3_dir, batch, params, monkeypatch, reference, speculative_config=spec,
                                   **graph_backends, compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE",
                                                                         "cudagraph_capture_sizes": [12]})
    assert graphed == eager
    assert runs, "mixed steps were meant to run in pieces"
    assert llm.llm_engine.spec_decode_stats.num_accepted_tokens > 0


def test_attn_res_falls_back_from_piecewise(graph_backends, model_dir):
    llm = LLM(model=model_dir, tokenizer=str(TINY_TOKENIZER_DIR), dtype="float32", max_model_len=64,
              max_num_batched_tokens=24, max_num_seqs=2, **graph_backends,
              compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [2]})
    runner = llm.llm_engine.runner
    assert runner.cudagraph_mode is CUDAGraphMode.FULL_DECODE_ONLY and runner.graphs.piecewise is None
