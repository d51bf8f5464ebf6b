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
from code_prompts import CODE_PROMPTS
from spec_helpers import ScriptedProposer

from vllm import LLM, SamplingParams
from vllm.assets import DEFAULT_MODEL_DIR, TINY_TOKENIZER_DIR
from vllm.attention.kda import native
from vllm.worker.cudagraph import CUDAGraphMode


def _generate(model_dir, batch, params, reference=None, tokenizer=str(TINY_TOKENIZER_DIR), **kwargs):
    llm = LLM(model=model_dir, tokenizer=tokenizer, dtype="float32", max_model_len=128,
              max_num_batched_tokens=32, max_num_seqs=4, **kwargs)
    if reference is not None:  # drafts right and wrong by design, so verify rows of 0..K drafts replay
        K = llm.llm_engine.num_spec
        llm.llm_engine.runner.drafting.ngram = ScriptedProposer(reference, K, llm.llm_engine.vocab_size)
    replayed = []
    graphs = llm.llm_engine.runner.graphs.captured
    if graphs is not None:  # record what replays, real CUDA graphs or the CPU stand-in alike
        replay = graphs.replay
        graphs.replay = lambda desc: replayed.append(desc) or replay(desc)
    outs = llm.generate(batch, params, use_tqdm=False)
    llm.llm_engine.kv_cache_manager.assert_all_free()
    return llm, [o.outputs[0].token_ids for o in outs], replayed


@pytest.mark.parametrize("K", [0, 2])
def test_graph_replay_equals_eager(graph_backends, model_dir, K):
    gen = torch.Generator().manual_seed(K)
    # Three requests on graphs of up to 4 requests: every replay pads zero-length rows and no-op tokens.
    batch = [{"prompt_token_ids": torch.randint(5, 250, (n,), generator=gen).tolist()} for n in (9, 3, 20)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": K} if K else None
    _, eager, _ = _generate(model_dir, batch, params, enforce_eager=True, **graph_backends)
    reference = {tuple(p["prompt_token_ids"]): out for p, out in zip(batch, eager)} if K else None
    llm, graphed, replayed = _generate(model_dir, batch, params, reference, speculative_config=spec, **graph_backends,
                             compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY",
                                                 "cudagraph_capture_sizes": [4, 12]})
    runner = llm.llm_engine.runner
    assert runner.cudagraph_mode is CUDAGraphMode.FULL_DECODE_ONLY
    assert graphed == eager
    assert replayed, "decode steps were meant to replay graphs"
    assert all(d.max_query_len == 1 + K for d in replayed), "only bounded decode/verify graphs replay"
    assert any(d.num_reqs > 3 for d in replayed), "three requests on 4-request graphs: padding rows replayed"
    if K:
        assert llm.llm_engine.spec_decode_stats.num_accepted_tokens > 0, "verify rows kept drafts in graphs"


@pytest.mark.parametrize("K", [0, 3])
def test_graph_replay_equals_eager_on_the_trained_model(graph_backends, K, monkeypatch):
    """The built-in model's peaked logits on code, with the real ngram proposer: its drafts are accepted, so
    verify rows that keep 1..K drafts replay, and a replay that read one stale value would change the code.
    The interpreter runs the decode kernel at about 1 s per layer and request: the CPU runs a short case."""
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        if K == 0:
            pytest.skip("on the CPU the verify case (K=3) covers the one-token decode rows too")
        # One program per (request, head): the interpreter runs programs one after another, and split heads
        # are covered at tiny shapes above.
        monkeypatch.setattr(native, "num_sms", lambda device: 1)
    batch = CODE_PROMPTS[:3] if on_gpu else CODE_PROMPTS[1:3]
    params = SamplingParams(temperature=0.0, max_tokens=24 if on_gpu else 10, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": K} if K else None
    _, eager, _ = _generate(str(DEFAULT_MODEL_DIR), batch, params, tokenizer=None, enforce_eager=True,
                            speculative_config=spec, **graph_backends)
    llm, graphed, replayed = _generate(str(DEFAULT_MODEL_DIR), batch, params, tokenizer=None,
                                       speculative_config=spec, **graph_backends,
                                       compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY",
                                                           "cudagraph_capture_sizes": [4, 12]})
    assert graphed == eager
    assert replayed and all(d.max_query_len == 1 + K for d in replayed)
    if K:
        stats = llm.llm_engine.spec_decode_stats
        assert stats.num_accepted_tokens_per_pos[K - 1] > 0, "verify rows that kept every draft replayed"


def test_a_failed_capture_names_the_backends_and_the_way_out(graph_backends, model_dir, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the stand-in capture is the CPU path")
    from vllm.worker import graphs

    def refuse(self, desc, fn, warmup=1):
        raise RuntimeError("operation not permitted when stream is capturing")
    # graphs.CUDAGraphRunner is the fixture's stand-in here.
    monkeypatch.setattr(graphs.CUDAGraphRunner, "capture", refuse)
    with pytest.raises(RuntimeError, match=r"KDA decode native.*--enforce-eager"):
        LLM(model=model_dir, tokenizer=str(TINY_TOKENIZER_DIR), dtype="float32", max_model_len=128,
            compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [4]},
            **graph_backends)


@pytest.mark.parametrize("K", [0, 2])
def test_a_short_prompt_on_a_recycled_slot_runs_eagerly(graph_backends, model_dir, K):
    """A prompt chunk of 1..1+K tokens beside decode rows fits a decode graph's shape. Replayed there, the decode
    kernel would start from whatever its recycled state slot still holds instead of from zeros; the runner must
    run such a step eagerly, and the request's text must equal an eager run's."""
    gen = torch.Generator().manual_seed(10 + K)
    prompts = {rid: torch.randint(5, 250, (n,), generator=gen).tolist() for rid, n in (("a", 9), ("c", 7), ("d", 11))}
    prompts["b"] = torch.randint(5, 250, (1 + K,), generator=gen).tolist()
    lengths = {"a": 2, "b": 4, "c": 10, "d": 10}
    spec = {"method": "ngram", "num_speculative_tokens": K} if K else None

    def run(**kwargs):
        llm = LLM(model=model_dir, tokenizer=str(TINY_TOKENIZER_DIR), dtype="float32", max_model_len=128,
                  max_num_batched_tokens=32, max_num_seqs=4, speculative_config=spec, **graph_backends, **kwargs)
        engine, kv = llm.llm_engine, llm.llm_engine.kv_cache_manager
        tokens, slots = {}, {}

        def step():
            for out in engine.step():
                tokens[out.request_id] = out.outputs[0].token_ids
            slots.update({rid: set(s) for rid, s in kv.req_slots.items()})

        for rid in ("a", "c", "d"):
            engine.add_request(rid, {"prompt_token_ids": prompts[rid]},
                               SamplingParams(temperature=0.0, max_tokens=lengths[rid], ignore_eos=True))
        while "a" in kv.req_slots or "a" not in slots:
            step()
        engine.add_request("b", {"prompt_token_ids": prompts["b"]},
                           SamplingParams(temperature=0.0, max_tokens=lengths["b"], ignore_eos=True))
        step()
        assert slots["b"] == slots["a"], "b's prompt runs on the state slots a just gave back"
        while engine.has_unfinished_requests():
            step()
        kv.assert_all_free()
        return llm, tokens

    _, eager = run(enforce_eager=True)
    llm, graphed = run(compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [4, 12]})
    assert llm.llm_engine.runner.graphs.captured is not None
    assert graphed == eager
