"""RecoverSSM (`--use-replayssm`) end to end on the CPU: one KDA state per speculating request, verify rows that
record, a commit after sampling. Greedy output equals the run without speculation (which the checkpoint-column
runs equal too: tests/engine/test_spec_decode.py) for ngram and DSpark drafts at K = 1..7, with every accepted
count, under chunking, preemption, aborts and async scheduling; combinations that cannot run are refused; the
capacity line reports both layouts; nothing leaks."""
from __future__ import annotations

import logging

import pytest
from code_prompts import CODE_PROMPTS
from spec_helpers import ScriptedProposer

from vllm import LLM, SamplingParams
from vllm.assets import DEFAULT_DSPARK_DIR
from vllm.engine.arg_utils import EngineArgs
from vllm.worker.cache_sizing import speculating_state_bytes

GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
KS = [1, 2, 3, 4, 5, 6, 7]


def _llm(spec=None, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 256)
    kwargs.setdefault("max_num_batched_tokens", 32)
    return LLM(dtype="float32", speculative_config=spec, **kwargs)


def _ids(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _dspark(K: int) -> dict:
    return {"method": "dspark", "model": str(DEFAULT_DSPARK_DIR), "num_speculative_tokens": K}


def _stopped_at(llm: LLM, K: int) -> list[int]:
    """How many verify rows kept exactly j drafts, j = 0..K."""
    stats = llm.llm_engine.spec_decode_stats
    per_pos = stats.num_accepted_tokens_per_pos
    return [stats.num_drafts - per_pos[0]] + [per_pos[j - 1] - (per_pos[j] if j < K else 0) for j in range(1, K + 1)]


def _finish(llm: LLM) -> None:
    assert not llm.llm_engine.has_unfinished_requests()
    llm.llm_engine.kv_cache_manager.assert_all_free()


@pytest.fixture(scope="module")
def reference() -> dict[tuple[int, ...], list[int]]:
    """The code prompts' greedy continuations without speculation, by prompt token ids."""
    outs = _llm().generate(CODE_PROMPTS, GREEDY, use_tqdm=False)
    return {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in outs}


@pytest.mark.parametrize("K", KS)
def test_scripted_ngram_drafts_commit_every_count_and_stay_lossless(reference, K):
    llm = _llm({"method": "ngram", "num_speculative_tokens": K}, use_replayssm=True)
    assert llm.llm_engine.kv_cache_manager.slots_per_request == 1
    llm.llm_engine.runner.drafting.ngram = ScriptedProposer(reference, K, llm.llm_engine.vocab_size)
    got = llm.generate([{"prompt_token_ids": list(p)} for p in reference], GREEDY, use_tqdm=False)
    assert _ids(got) == list(reference.values())
    assert all(n > 0 for n in _stopped_at(llm, K)), "every accepted count 0..K was committed"
    _finish(llm)


@pytest.mark.parametrize("K", KS)
def test_dspark_drafts_stay_lossless(reference, K):
    llm = _llm(_dspark(K), use_replayssm=True)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    got = llm.generate(CODE_PROMPTS[:2], params, use_tqdm=False)
    assert _ids(got) == [ids[:20] for ids in list(reference.values())[:2]]  # greedy: a prefix of the longer run
    assert llm.llm_engine.spec_decode_stats.num_accepted_tokens > 0
    _finish(llm)


def test_dspark_is_lossless_under_chunking_preemption_aborts_and_async_scheduling():
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = [p * n for p, n in zip(CODE_PROMPTS, (1, 6, 2, 9))]
    want = _ids(_llm(max_model_len=128).generate(prompts, params, use_tqdm=False))
    llm = _llm(_dspark(3), use_replayssm=True, max_num_batched_tokens=16, num_gpu_blocks_override=9,
               max_model_len=128, async_scheduling=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert _ids(outs) == want
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    for _ in range(6):
        engine.step()
    engine.abort_request(["r1"])
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    assert [done[f"r{i}"] for i in (0, 2, 3)] == [want[i] for i in (0, 2, 3)]
    _finish(llm)


def test_combinations_that_cannot_run_are_refused_naming_them():
    with pytest.raises(ValueError, match="--use-replayssm needs speculative decoding"):
        EngineArgs(device="cpu", use_replayssm=True).create_engine_config()
    with pytest.raises(ValueError, match="--kda-decode-backend=triton .*RecoverSSM's per-token records"):
        _llm({"method": "ngram", "num_speculative_tokens": 3}, use_replayssm=True, kda_decode_backend="triton")


def test_one_state_per_request_fits_the_target_and_the_capacity_line_reports_both(caplog):
    config = EngineArgs(device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 3},
                        use_replayssm=True).create_engine_config()
    columns, recover = speculating_state_bytes(config)
    assert recover <= 0.4 * columns, (recover, columns)  # the target at K = 3
    with caplog.at_level(logging.INFO, logger="vllm.worker.cache_sizing"):
        llm = _llm({"method": "ngram", "num_speculative_tokens": 3}, use_replayssm=True)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("cache capacity"))
    assert "RecoverSSM:" in line and f"checkpoint columns {columns / 2**20:.2f} MiB" in line, line
    layout = llm.llm_engine.runner.layout
    assert layout.record_bytes > 0 and layout.num_state_slots == llm.llm_engine.kv_cache_manager.num_state_slots


@pytest.mark.gpu
@pytest.mark.parametrize("adaptive", [False, True], ids=["dspark7", "adaptive7"])
def test_graphs_async_and_adaptive_verification_on_the_gpu(adaptive):
    """The native kernel's record mode and the Triton commit inside the engine's default CUDA graphs, with async
    scheduling, at K = 7 with and without adaptive verification: greedy equal to no speculation."""
    backends = dict(device="cuda", attention_backend="TRITON_MLA", kda_prefill_backend="torch",
                    kda_decode_backend="native", max_num_seqs=16, gpu_memory_utilization=0.3)
    want = _ids(_llm(**backends).generate(CODE_PROMPTS, GREEDY, use_tqdm=False))
    spec = {**_dspark(7), "enable_adaptive_verification": adaptive}
    llm = _llm(spec, use_replayssm=True, async_scheduling=True, **backends)
    assert llm.llm_engine.runner.graphs.captured is not None and llm.llm_engine.runner.state_commit is not None
    assert _ids(llm.generate(CODE_PROMPTS, GREEDY, use_tqdm=False)) == want
    assert llm.llm_engine.spec_decode_stats.num_accepted_tokens > 0
    _finish(llm)
