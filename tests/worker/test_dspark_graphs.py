"""The DSpark draft in CUDA graphs: the runner captures one draft graph per (request count, context bucket), the
step's context writes ride in the target's graphs, and greedy output is the eager run's. Off CUDA the stand-in
(tests/graph_standin.py) reruns what was captured and refuses host syncs inside it."""
from __future__ import annotations

import torch

from vllm import LLM, SamplingParams
from vllm.assets import TINY_TOKENIZER_DIR
from vllm.spec_decode.dspark import DraftGraphKey, context_buckets
from vllm.tools.make_dspark_draft import write_dspark_draft


def _llm(model_dir, backends, **kwargs) -> LLM:
    return LLM(model=model_dir, tokenizer=str(TINY_TOKENIZER_DIR), dtype="float32", max_model_len=128,
               max_num_batched_tokens=32, max_num_seqs=4, **backends, **kwargs)


def test_context_buckets_double_up_to_max_model_len():
    assert context_buckets(128) == [64, 128]
    assert context_buckets(1000) == [64, 128, 256, 512, 1000]
    assert context_buckets(40) == [40]


def test_draft_graphs_replay_and_equal_eager(graph_backends, model_dir, tmp_path):
    draft = write_dspark_draft(tmp_path / "draft", target_dir=model_dir, seed=5)
    spec = {"method": "dspark", "model": draft, "num_speculative_tokens": 3}
    gen = torch.Generator().manual_seed(6)
    # Two requests of different lengths (the shorter finishes first: one, then two, then one row drafts) and
    # contexts that cross the first bucket (64) while decoding.
    batch = [{"prompt_token_ids": torch.randint(5, 250, (n,), generator=gen).tolist()} for n in (58, 9)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (16, 7)]
    want = [o.outputs[0].token_ids for o in _llm(model_dir, graph_backends, enforce_eager=True)
            .generate(batch, params, use_tqdm=False)]
    eager_spec = _llm(model_dir, graph_backends, enforce_eager=True, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in eager_spec.generate(batch, params, use_tqdm=False)] == want

    llm = _llm(model_dir, graph_backends, enforce_eager=False, speculative_config=spec,
               compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [4, 8]})
    drafter = llm.llm_engine.runner.drafter
    # The verify graphs (4 and 8 tokens) are varlen: rows of 1..1+K tokens, up to max_num_seqs = 4 of them. So
    # the draft has one request count, 4, times both buckets; one or two drafting rows pad to it.
    assert drafter.graph_keys == {DraftGraphKey(4, 64), DraftGraphKey(4, 128)}
    replayed = []
    replay = drafter.graphs.replay
    runner = llm.llm_engine.runner
    step = {"graph": False}

    def spy(key):
        replayed.append(key)
        step["graph"] |= not isinstance(key, DraftGraphKey)
        return replay(key)

    drafter.graphs.replay = spy  # the runner's graphs too: target and draft share one CUDAGraphRunner
    execute, verify = runner.execute_model, runner.sample_step._verify
    runner.execute_model = lambda *a, **kw: step.update(graph=False) or execute(*a, **kw)
    eager_verifies = []  # per eager rejection: whether its step replayed a target graph
    runner.sample_step._verify = lambda *a, **kw: eager_verifies.append(step["graph"]) or verify(*a, **kw)
    got = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    assert got == want
    # Greedy rows are verified and anchored inside the verify graphs (the decode tail): only steps that run
    # eagerly (a prompt chunk beside a verify row) reach the eager rejection sampler.
    assert not any(eager_verifies)
    assert any(not isinstance(k, DraftGraphKey) and k.max_query_len for k in replayed)
    drafted = [k for k in replayed if isinstance(k, DraftGraphKey)]
    assert {k.max_context for k in drafted} == {64, 128}, "drafts replayed on both sides of the bucket edge"
    assert llm.llm_engine.spec_decode_stats.num_draft_tokens > 0
    llm.llm_engine.kv_cache_manager.assert_all_free()
