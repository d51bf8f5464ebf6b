"""Speculative decoding end to end: greedy outputs identical with and without speculation (ngram drafts and
scripted drafts with chosen rejections), over batches that mix prompt chunks, verify rows with 0..K drafts,
padded prompt tails and preemption; metrics add up; nothing leaks."""
from __future__ import annotations

import pytest
import torch

from code_prompts import CODE_PROMPTS
from spec_helpers import ScriptedProposer

from vllm import LLM, SamplingParams
from vllm.core.sentinels import PLACEHOLDER_TOKEN_ID

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

# fla's chunk kernels compute fp32 dots in TF32, so the `triton` prefill and the fp32 decode kernels disagree beyond
# fp32 rounding. Speculation runs a padded prompt tail through the decode kernel where plain decoding runs it
# through the prefill kernel; on the H200 that flipped a near-tied greedy token of the random model at K=7
# (both TRITON_MLA+triton+native and TORCH_MLA+triton+torch, eager and graphs alike). The engine logic is
# checked with torch prefill below; the triton-prefill rows stay, expected to diverge until fp32 means fp32 there.
TF32_PREFILL = pytest.mark.xfail(reason="fla's chunk_kda uses TF32 dots for fp32 inputs (see GPU_COMBOS)")
GPU_COMBOS = [dict(attention_backend="TRITON_MLA", kda_prefill_backend="torch", kda_decode_backend="native"),
              dict(attention_backend="TORCH_MLA", kda_prefill_backend="torch", kda_decode_backend="native"),
              dict(attention_backend="TRITON_MLA", kda_prefill_backend="torch", kda_decode_backend="torch"),
              dict(attention_backend="TORCH_MLA", kda_prefill_backend="torch", kda_decode_backend="torch"),
              pytest.param(dict(attention_backend="TRITON_MLA", kda_prefill_backend="triton",
                                kda_decode_backend="native"), marks=TF32_PREFILL),
              pytest.param(dict(attention_backend="TORCH_MLA", kda_prefill_backend="triton",
                                kda_decode_backend="torch"), marks=TF32_PREFILL)]


def make_llm(device, K=None, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 256)
    kwargs.setdefault("max_num_batched_tokens", 32)
    spec = None if K is None else {"method": "ngram", "num_speculative_tokens": K}
    return LLM(device=device, dtype="float32", speculative_config=spec, **kwargs)


def repetitive_prompts(lengths, seed=0) -> list[dict]:
    """Prompts that repeat a short random phrase, so ngram lookup finds matches."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        phrase = torch.randint(5, 500, (int(torch.randint(2, 6, (), generator=gen)),), generator=gen).tolist()
        out.append({"prompt_token_ids": (phrase * n)[:n]})
    return out


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def finish(llm: LLM) -> None:
    assert not llm.llm_engine.has_unfinished_requests()
    llm.llm_engine.kv_cache_manager.assert_all_free()


def record_tags(llm: LLM) -> list[list[tuple[int, list[int]]]]:
    """Wraps the scheduler to keep each step's rows as (tag, drafts)."""
    steps: list[list[tuple[int, list[int]]]] = []
    sched = llm.llm_engine.scheduler
    schedule = sched.schedule

    def recording():
        out = schedule()
        steps.append([(s.num_draft_tokens, list(s.draft_token_ids)) for s in out.scheduled])
        return out
    sched.schedule = recording
    return steps


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("K", [1, 3, 7])
def test_ngram_speculation_is_lossless(device, K):
    batch = repetitive_prompts([5, 40, 1, 77, 16, 23, 9], seed=K)
    want = make_llm(device).generate(batch, GREEDY, use_tqdm=False)
    llm = make_llm(device, K)
    steps = record_tags(llm)
    got = llm.generate(batch, GREEDY, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    tags = [t for step in steps for t, _ in step]
    assert any(t > 0 for t in tags) and -1 in tags, "the run must verify drafts and prefill"
    finish(llm)


@pytest.mark.parametrize("K", [1, 3, 7])
def test_ngram_drafts_are_accepted_on_the_trained_model_and_stay_lossless(K):
    # The built-in model is trained: its greedy code repeats itself, so ngram drafts are accepted, and every
    # acceptance count from 0 to K occurs (the accepted-draft paths run, not only the all-rejected one).
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    want = make_llm("cpu").generate(CODE_PROMPTS, params, use_tqdm=False)
    llm = make_llm("cpu", K)
    got = llm.generate(CODE_PROMPTS, params, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    drafts = sum(o.metrics.spec_num_drafts for o in got)
    per_pos = [sum(col) for col in zip(*(o.metrics.spec_num_accepted_tokens_per_pos for o in got))]
    assert len(per_pos) == K and per_pos[0] > 0, per_pos
    # Verifies that accepted at least j drafts and stopped there, for j = 0..K: each kind occurs.
    stopped_at = [drafts - per_pos[0]] + [per_pos[j - 1] - (per_pos[j] if j < K else 0) for j in range(1, K + 1)]
    assert all(n > 0 for n in stopped_at), (drafts, per_pos)
    finish(llm)


def _scripted_run(device, K, batch, params, graphs=False, **kwargs):
    want = make_llm(device, enforce_eager=True, **kwargs).generate(batch, params, use_tqdm=False)
    graph_config = {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [4, 8, 16, 32]}
    llm = make_llm(device, K, compilation_config=graph_config if graphs else None, **kwargs)
    vocab = llm.llm_engine.vocab_size
    reference = {tuple(p["prompt_token_ids"]): o.outputs[0].token_ids for p, o in zip(batch, want)}
    llm.llm_engine.runner.drafting.ngram = ScriptedProposer(reference, K, vocab)
    steps = record_tags(llm)
    got = llm.generate(batch, params, use_tqdm=False)
    return want, got, llm, steps


@pytest.mark.parametrize("device,graphs", [("cpu", False), pytest.param("cuda", False, marks=pytest.mark.gpu),
                                           pytest.param("cuda", True, marks=pytest.mark.gpu)],
                         ids=["cpu", "cuda-eager", "cuda-graphs"])
@pytest.mark.parametrize("K", [1, 3, 7])
def test_scripted_drafts_are_lossless_and_counted(device, graphs, K):
    # 33 tokens with a 32-token budget: the last prompt token runs as a padded tail (K placeholders).
    batch = repetitive_prompts([33, 40, 1, 77, 16, 23], seed=10 + K)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    backends = {} if device == "cpu" else GPU_COMBOS[0]  # the graph-capable kernels; torch prefill (TF32 note)
    want, got, llm, steps = _scripted_run(device, K, batch, params, graphs, **backends)
    assert token_ids(got) == token_ids(want)
    # The padded tail ran as a verify row: tag K (or fewer if the budget trimmed it), placeholders only.
    first_steps = [row for step in steps[:3] for row in step]
    assert any(tag > 0 and drafts == [PLACEHOLDER_TOKEN_ID] * tag for tag, drafts in first_steps)
    # Verify rows of every draft count met prompt chunks in the same steps.
    assert any(-1 in [t for t, _ in step] and any(t > 0 for t, _ in step) for step in steps)
    assert {t for step in steps for t, _ in step} >= set(range(-1, K + 1))
    stats = llm.llm_engine.spec_decode_stats
    assert stats.num_accepted_tokens_per_pos[K - 1] > 0, "some rows accepted all K drafts"
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, "some drafts were rejected"
    assert stats.num_accepted_tokens == sum(stats.num_accepted_tokens_per_pos)
    per_request = [o.metrics for o in got]
    assert sum(m.spec_num_drafts for m in per_request) == stats.num_drafts
    assert sum(m.spec_num_draft_tokens for m in per_request) == stats.num_draft_tokens
    assert sum(m.spec_num_accepted_tokens for m in per_request) == stats.num_accepted_tokens
    assert [sum(c) for c in zip(*(m.spec_num_accepted_tokens_per_pos for m in per_request))] == \
        stats.num_accepted_tokens_per_pos
    assert stats.mean_acceptance_length == pytest.approx(1 + stats.num_accepted_tokens / stats.num_drafts)
    assert stats.mean_acceptance_length > 1
    if graphs:
        captured = llm.llm_engine.runner.graphs.captured
        assert captured is not None, "FULL_DECODE_ONLY was asked for and graphs were captured"
    finish(llm)


@pytest.mark.gpu
@pytest.mark.parametrize("backends", GPU_COMBOS, ids=lambda b: "+".join(b.values()))
def test_every_backend_combination_is_lossless_on_the_gpu(backends):
    """K=7 scripted drafts with graphs asked for: combinations that cannot capture (a torch backend) run eager
    after the logged downgrade; the graph-capable one replays its decode graphs."""
    batch = repetitive_prompts([33, 40, 1, 77, 16, 23], seed=17)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    want, got, llm, _ = _scripted_run("cuda", 7, batch, params, graphs=True, **backends)
    assert token_ids(got) == token_ids(want)
    graph_capable = backends["attention_backend"] == "TRITON_MLA" and backends["kda_decode_backend"] == "native"
    assert (llm.llm_engine.runner.graphs.captured is not None) == graph_capable
    finish(llm)


@pytest.mark.parametrize("device", DEVICES)
def test_speculation_survives_preemption(device):
    # 6 blocks of 16 tokens cannot hold four growing requests: the newest are preempted and recomputed.
    batch = repetitive_prompts([20, 18, 25, 12], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want, got, llm, _ = _scripted_run(device, 3, batch, params, num_gpu_blocks_override=6, max_model_len=64)
    assert token_ids(got) == token_ids(want)
    assert max(o.metrics.num_preemptions for o in got) > 0, "the cache was meant to force a preemption"
    finish(llm)


@pytest.mark.parametrize("device", DEVICES)
def test_requests_that_cannot_speculate_share_steps_with_verify_rows(device):
    """logprobs, penalties and min_tokens need the plain sampler: those requests decode one token per step
    next to verify rows, and get what they get without speculation."""
    batch = repetitive_prompts([30, 12, 20], seed=5)
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3, min_tokens=4)]
    want = make_llm(device).generate(batch, params, use_tqdm=False)
    llm = make_llm(device, 3)
    reference = {tuple(p["prompt_token_ids"]): o.outputs[0].token_ids for p, o in zip(batch, want)}
    llm.llm_engine.runner.drafting.ngram = ScriptedProposer(reference, 3, llm.llm_engine.vocab_size)
    steps = record_tags(llm)
    got = llm.generate(batch, params, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    for a, b in zip(got[1].outputs[0].logprobs, want[1].outputs[0].logprobs):
        assert a.keys() == b.keys()
    assert [o.metrics.spec_num_drafts for o in got[1:]] == [0, 0]
    # The first request did verify drafts, in the same steps as the other two decoded one token each.
    assert got[0].metrics.spec_num_drafts > 0
    assert any(sorted(t for t, _ in step) in ([0, 0, 1], [0, 0, 2], [0, 0, 3]) for step in steps)
    finish(llm)


def test_seeded_random_sampling_with_speculation_runs_to_length():
    batch = repetitive_prompts([30, 12], seed=6)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=7, ignore_eos=True)
    llm = make_llm("cpu", 3)
    outs = llm.generate(batch, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [20, 20]
    again = make_llm("cpu", 3).generate(batch, params, use_tqdm=False)
    assert token_ids(again) == token_ids(outs), "seeded requests are reproducible run to run"
    finish(llm)


def test_bad_speculative_configs_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(device="cpu", speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(device="cpu", speculative_config='{"method": ngram}')
    with pytest.raises(ValueError, match="checkpoints"):
        LLM(device="cpu", kda_decode_backend="triton",
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_cli_flags_reach_the_engine_config():
    import argparse

    from vllm.engine.arg_utils import EngineArgs
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--device", "cpu", "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 6}',
                              "--compilation-config", '{"cudagraph_mode": "FULL", "cudagraph_capture_sizes": [8, 2]}'])
    cfg = EngineArgs.from_cli_args(args).create_engine_config()
    assert (cfg.num_speculative_tokens, cfg.speculative_config.prompt_lookup_max) == (2, 6)
    assert (cfg.compilation_config.cudagraph_mode, cfg.compilation_config.cudagraph_capture_sizes) == ("FULL", [2, 8])
    assert cfg.compilation_config.resolved_mode(torch.device("cpu")) == "NONE", "no graphs off CUDA"
    for bad, match in [('{"cudagraph_mode": "PIECEWISE_ONLY"}', "cudagraph_mode"), ('{"sizes": [1]}', "keys"),
                       ('{"cudagraph_capture_sizes": [0]}', "cudagraph_capture_sizes"), ("{", "not valid JSON")]:
        with pytest.raises(ValueError, match=match):
            EngineArgs(device="cpu", compilation_config=bad).create_engine_config()
