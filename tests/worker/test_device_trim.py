"""The adaptive-verification seam: drafts trimmed on the device after the host metadata was built (host and
device row lengths differ row by row, same total) still give exactly the tokens of a run without speculation,
because every kernel and the rejection sampler read the device offsets."""
from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.assets import TINY_TOKENIZER_DIR


class RightDrafts:
    """Always proposes the next K tokens of the reference run, so only the trimming decides what is verified."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], K: int) -> None:
        self.reference, self.K = reference, K

    def propose(self, tokens: np.ndarray) -> list[int]:
        tokens = np.asarray(tokens).tolist()
        for prompt, ref in self.reference.items():
            if tuple(tokens[:len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                return list(ref[done:done + self.K])
        raise AssertionError("a request the proposer does not know")


def uneven_trim(calls: list):
    """Odd rows lose two drafts on the device; the host shows the same total spread evenly: with two rows
    of 1 + 3 tokens that is host [3, 3], device [4, 2]."""
    def hook(out, common):
        scheduled = common.query_lens_cpu.tolist()
        device = [n if r % 2 == 0 else max(1, n - 2) for r, n in enumerate(scheduled)]
        total, rows = sum(device), len(device)
        host = [total // rows + (r < total % rows) for r in range(rows)]
        calls.append((host, device))
        return host, torch.tensor(device, dtype=torch.int32, device=common.query_start_loc.device)
    return hook


def _llm(model_dir, backends, **kwargs) -> LLM:
    kwargs.setdefault("enforce_eager", True)
    kwargs.setdefault("max_num_batched_tokens", 32)
    return LLM(model=model_dir, tokenizer=str(TINY_TOKENIZER_DIR), dtype="float32", max_model_len=128,
               max_num_seqs=4, **backends, **kwargs)


@pytest.mark.parametrize("recover", [False, True], ids=["checkpoint-columns", "recoverssm"])
def test_device_trimmed_drafts_stay_lossless(graph_backends, model_dir, recover):
    """Also under RecoverSSM, where the native kernel records (in the interpreter here) and the trimmed rows
    commit only what their device lengths verified."""
    gen = torch.Generator().manual_seed(1)
    batch = [{"prompt_token_ids": torch.randint(5, 250, (n,), generator=gen).tolist()} for n in (7, 12, 9)]
    # Three rows first (the trimmed middle row shifts the last one), then two once the third is done.
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 12, 4)]
    want = [o.outputs[0].token_ids for o in _llm(model_dir, graph_backends).generate(batch, params, use_tqdm=False)]
    llm = _llm(model_dir, graph_backends, speculative_config={"method": "ngram", "num_speculative_tokens": 3},
               use_replayssm=recover)
    right = {tuple(p["prompt_token_ids"]): w for p, w in zip(batch, want)}
    llm.llm_engine.runner.drafting.ngram = RightDrafts(right, 3)
    assert (llm.llm_engine.runner.state_commit is not None) is recover
    calls = []
    llm.llm_engine.runner.set_device_trim_hook(uneven_trim(calls))
    got = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    assert got == want
    assert ([3, 3], [4, 2]) in calls, "the host [3, 3] / device [4, 2] step ran"
    stats = llm.llm_engine.spec_decode_stats
    # Trimmed drafts count as rejected: fewer accepted than proposed although every draft was right.
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_unverified_draft_tokens is None  # a hook of its own, not adaptive verification's counters
    llm.llm_engine.kv_cache_manager.assert_all_free()


def test_backends_reading_host_lengths_refuse_the_hook(tmp_path):
    llm = LLM(device="cpu", max_model_len=64, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="read the host copies"):
        llm.llm_engine.runner.set_device_trim_hook(uneven_trim([]))


def test_trim_on_device_recuts_every_per_token_buffer():
    from vllm.config import SchedulerConfig
    from vllm.core.kv_cache_manager import KVCacheManager
    from vllm.core.request import Request
    from vllm.core.scheduler import Scheduler
    from vllm.worker.input_batch import InputBatch
    K, bs = 3, 4
    kv = KVCacheManager(64, bs, 1 + 3 * (1 + K), needs_blocks=True, needs_slots=True, slots_per_request=1 + K)
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=64), kv, K)
    reqs = [Request(r, list(range(10 * i + 5, 10 * i + 5 + n)), SamplingParams(max_tokens=8), 8, speculate=True)
            for i, (r, n) in enumerate([("a", 6), ("b", 9), ("c", 3)])]
    for r in reqs:
        sched.add_request(r)
    sched.update_from_output(sched.schedule(), {r.request_id: [200 + i] for i, r in enumerate(reqs)})
    for r, drafts in zip(reqs, ([1, 2, 3], [4, 5, 6], [7, -1, -1])):
        r.spec_token_ids = drafts  # -1 stand for placeholders: they must stay -1 as draft ids
    out = sched.schedule()
    batch = InputBatch(3, 32, 16, bs, torch.device("cpu"), slots_per_request=1 + K)
    full = batch.prepare(out, kv)
    assert full.query_lens_cpu.tolist() == [4, 4, 4]
    ids, drafts, pos = (b.gpu[:12].tolist() for b in (batch.input_ids, batch.draft_ids, batch.positions))
    slots, seq_lens = batch.slot_mapping.gpu[:12].tolist(), batch.seq_lens.gpu[:3].tolist()

    device = [2, 4, 3]
    common = batch.trim_on_device(full, [3, 3, 3], torch.tensor(device, dtype=torch.int32))
    keep = [4 * r + j for r, n in enumerate(device) for j in range(n)]  # row r keeps its first n tokens
    assert common.query_start_loc.tolist() == [0, 2, 6, 9] and common.query_start_loc_cpu.tolist() == [0, 3, 6, 9]
    assert (common.num_actual_tokens, common.max_query_len) == (9, 4)  # the bound stays the scheduled one
    assert batch.input_ids.gpu[:9].tolist() == [ids[i] for i in keep]
    assert batch.draft_ids.gpu[:9].tolist() == [drafts[i] for i in keep]
    assert batch.draft_ids.gpu[6:9].tolist() == [200 + 2, 7, -1]
    assert batch.positions.gpu[:9].tolist() == [pos[i] for i in keep]
    assert common.slot_mapping.tolist() == [slots[i] for i in keep]
    assert common.seq_lens.tolist() == [s - (4 - n) for s, n in zip(seq_lens, device)]
    assert common.seq_lens_cpu.tolist() == seq_lens  # the host keeps the scheduled lengths as an upper bound
    # The pinned host buffer still holds the scheduled offsets: its copy to the device may not have run yet.
    assert batch.query_start_loc.np[:4].tolist() == [0, 4, 8, 12]
    # The next step of the same rows sends its offsets again: the device's are the trim's, not the host's (a step
    # whose offsets match the last ones sent otherwise skips that copy).
    again = batch.prepare(out, kv)
    assert again.query_start_loc.tolist() == [0, 4, 8, 12] and batch.input_ids.gpu[:12].tolist() == ids


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_adaptive_verification_with_dspark_is_lossless_and_recuts_on_the_device(graph_backends, model_dir,
                                                                              tmp_path, monkeypatch,
                                                                              async_scheduling):
    """`enable_adaptive_verification` through the real DSpark path: start-up cost tables, b* from the draft's
    confidences, the host's even split against the device's survival split (host [3, 3] against device [4, 2]
    or [2, 4] once the budget is 4 for two rows of three drafts), and greedy output equal to no speculation;
    also with async scheduling, where the next step is re-cut before the host has the last one's tokens."""
    from vllm.spec_decode import adaptive_verification as adaptive
    from vllm.tools.make_dspark_draft import write_dspark_draft
    draft = write_dspark_draft(tmp_path / "draft", target_dir=model_dir, seed=3)
    gen = torch.Generator().manual_seed(4)
    batch = [{"prompt_token_ids": torch.randint(5, 250, (n,), generator=gen).tolist()} for n in (7, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in _llm(model_dir, graph_backends).generate(batch, params, use_tqdm=False)]
    budgets = []

    def fixed_budget(survivals, *args, **kwargs):
        chosen = choose(survivals, *args, **kwargs)  # the real choice runs; the test then asks for 4
        budgets.append(chosen)
        return min(4, len(survivals))

    choose = adaptive.choose_budget
    monkeypatch.setattr(adaptive.verifier, "choose_budget", fixed_budget)  # where the hook reads it
    monkeypatch.setattr(adaptive.StepTimes, "stale", lambda self, *a: False)  # (GPU) no untrimmed re-measures
    monkeypatch.setattr(adaptive.profile, "COST_PROFILE_REPEATS", 1)  # the interpreter: ~1 s per dummy step
    # On a GPU adaptive verification runs in CUDA graphs (its start-up gate); on the CPU eagerly.
    graphs = {"enforce_eager": False, "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY",
                                                             "cudagraph_capture_sizes": [4, 8]}}
    llm = _llm(model_dir, graph_backends, **(graphs if torch.cuda.is_available() else {}),
               async_scheduling=async_scheduling, speculative_config={
                   "method": "dspark", "model": draft, "num_speculative_tokens": 3,
                   "enable_adaptive_verification": True})
    verifier = llm.llm_engine.runner.device_trim_hook
    assert isinstance(verifier, adaptive.AdaptiveVerifier)
    assert verifier.costs.verify(1) > 0 and verifier.costs.draft(1) >= 0 and verifier.costs.recut(1) > 0
    times = llm.llm_engine.runner.step_times
    assert verifier.times is times
    if times is not None:  # (GPU) every all-verify step through choose_budget, whose choice the test replaces:
        assert times.overlapped is async_scheduling  # under async scheduling a host-bound step keeps its drafts
        times.overlapped = False  # without asking it
    calls = []

    def spy(out, common):
        trim = verifier(out, common)
        if trim is not None:  # None: every draft kept, the step runs as scheduled
            calls.append((trim[0], trim[1].tolist()))
        return trim

    llm.llm_engine.runner.device_trim_hook = spy
    got = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    assert got == want
    assert calls and budgets, "all-verify steps ran through the adaptive hook"
    assert all(sum(h) == sum(d) and all(1 <= n <= 4 for n in h + d) for h, d in calls)
    assert any(h == [3, 3] and d in ([4, 2], [2, 4]) for h, d in calls), calls
    # On a GPU the engine timed its all-verify steps for the budget: the host's work, and whole periods by step
    # shape; on a CPU the host runs the forward itself, and the device tables alone decide.
    assert (times is not None) is torch.cuda.is_available()
    if times is not None:
        assert times.host > 0 and times.num_steps > 0
    # The engine's counters carry what the budgets left unverified (the test's budgets of 4 cut drafts).
    stats = llm.llm_engine.spec_decode_stats
    assert stats.num_unverified_draft_tokens == verifier.num_offered - verifier.num_kept > 0
    assert stats.num_remeasure_steps == verifier.num_refreshed
    llm.llm_engine.kv_cache_manager.assert_all_free()


def test_adaptive_verification_trims_by_measured_periods_and_remeasures_the_untrimmed_step(graph_backends, model_dir,
                                                                                          tmp_path, monkeypatch):
    """Measured step periods on the engine's real path (async scheduling). On a fake clock a step's device time
    is 1 s per target token and the host's work is free, so once measured, verifying any draft costs more than
    it can bring (a survival is at most 1 token for 1 s): the budget trims every step it can, yet verifies
    every draft on each step whose untrimmed shape was not measured lately (here every 5 periods). The shapes
    the engine records are the ones the budget looks up (else every step would re-measure and none trim), and
    greedy output equals no speculation throughout."""
    from types import SimpleNamespace

    from vllm.engine import llm_engine
    from vllm.spec_decode import adaptive_verification as adaptive
    from vllm.tools.make_dspark_draft import write_dspark_draft
    from vllm.worker.model_runner import AsyncModelRunnerOutput
    draft = write_dspark_draft(tmp_path / "draft", target_dir=model_dir, seed=3)
    gen = torch.Generator().manual_seed(5)
    batch = [{"prompt_token_ids": torch.randint(5, 250, (n,), generator=gen).tolist()} for n in (9, 6)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in _llm(model_dir, graph_backends).generate(batch, params, use_tqdm=False)]
    monkeypatch.setattr(adaptive.profile, "COST_PROFILE_REPEATS", 1)  # the interpreter: ~1 s per dummy step
    monkeypatch.setattr(adaptive.step_times, "REFRESH_STEPS", 5)
    graphs = {"enforce_eager": False, "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY",
                                                             "cudagraph_capture_sizes": [4, 8]}}
    llm = _llm(model_dir, graph_backends, **(graphs if torch.cuda.is_available() else {}), async_scheduling=True,
               speculative_config={"method": "dspark", "model": draft, "num_speculative_tokens": 3,
                                   "enable_adaptive_verification": True})
    runner = llm.llm_engine.runner
    verifier = runner.device_trim_hook
    # The tables in the fake clock's units (1 s per token, padded to the profiled sizes as the real ones): the
    # profiled ones time the interpreter, whose seconds vary with the machine's load, and a shape not measured
    # yet takes its table cost (the full suite on 2 cores once made a budget keep every draft by itself).
    real = verifier.costs.verify
    verifier.costs = adaptive.VerifyCosts(adaptive.CostCurve.from_samples({1: [0.0]}, 1),
                                          adaptive.CostCurve.from_samples({int(n): [float(n)] for n in real.sizes},
                                                                          real.max_captured))
    # Off CUDA the runner keeps no step times: these, on the fake clock, stand in for the ones a GPU records.
    runner.step_times = verifier.times = adaptive.StepTimes(True, verifier.costs.verify.padded)
    clock = [0.0]
    monkeypatch.setattr(llm_engine, "time", SimpleNamespace(perf_counter=lambda: clock[0], monotonic=time.monotonic))
    get_output = AsyncModelRunnerOutput.get_output

    def waiting(self):
        clock[0] += float(self.num_tokens)  # the device's time for the step waited for
        out = get_output(self)
        self.waited = float(self.num_tokens)
        return out

    monkeypatch.setattr(AsyncModelRunnerOutput, "get_output", waiting)
    trims = []

    def spy(out, common):
        trim = verifier(out, common)
        trims.append(trim is not None)
        return trim

    runner.device_trim_hook = spy
    got = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    assert got == want
    times = verifier.times
    assert times.host == 0.0 and times.num_steps >= len(trims) - 2  # every period but the last ones in flight
    kept = [t for t in trims if not t]
    # Off CUDA every untrimmed step is a re-measure. With graphs a budget may also keep every draft by itself:
    # periods of 5..8 tokens share the 8-token graph, whose median can undercut the 4-token graph's per token.
    assert sum(trims) >= 5 and (len(kept) == verifier.num_refreshed if not torch.cuda.is_available()
                                else len(kept) >= verifier.num_refreshed), trims
    # Three steps measure each number of requests' untrimmed shape, then one in every 5 periods re-measures it
    # (with graphs some of those are the budget's own choice, which need no re-measure).
    assert len(kept) >= adaptive.step_times.MIN_PERIOD_SAMPLES + 1
    assert verifier.num_refreshed <= 2 * adaptive.step_times.MIN_PERIOD_SAMPLES + len(trims) // 4
    full = f"2x{times.graph_tokens(2 + 2 * 3)}"
    assert times.summary_ms()[full] == pytest.approx(1e3 * (2 + 2 * 3))
    # The trimmed steps were recorded apart, as re-cut steps. Eagerly their budget is 0 (a row's current token
    # only); with graphs it takes the drafts the 4-token graph holds anyway (2 tokens cost as much as 4 there).
    assert times.summary_ms()[f"2x{times.graph_tokens(2)} re-cut"] == pytest.approx(1e3 * times.graph_tokens(2))
    llm.llm_engine.kv_cache_manager.assert_all_free()


@pytest.mark.parametrize("re_cut", [False, True], ids=["every-draft", "every-other-step-re-cut"])
def test_every_all_verify_step_calibrates_the_survivals_with_what_each_row_accepted(graph_backends, model_dir,
                                                                                   tmp_path, monkeypatch, re_cut):
    """Each all-verify step's prediction travels with its outputs to the engine (async scheduling: processed
    one step later), which hands back each row's accepted drafts. With nothing forgotten, the calibration's
    observed survivals are the engine's per-position acceptance counts exactly, over as many rows as
    verifications (one request: every verify step is an all-verify step, and its prefill step drafted, so the
    host always has its confidences). With every other step re-cut on the device to one draft, those steps
    count that slot alone: the runner hands the device's row lengths to their predictions."""
    from vllm.spec_decode import adaptive_verification as adaptive
    from vllm.tools.make_dspark_draft import write_dspark_draft
    draft = write_dspark_draft(tmp_path / "draft", target_dir=model_dir, seed=3)
    prompt = {"prompt_token_ids": torch.randint(5, 250, (11,), generator=torch.Generator().manual_seed(6)).tolist()}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = _llm(model_dir, graph_backends).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    monkeypatch.setattr(adaptive.profile, "COST_PROFILE_REPEATS", 1)  # the interpreter: ~1 s per dummy step
    budgets = itertools.count()
    monkeypatch.setattr(adaptive.verifier, "choose_budget", lambda survivals, *a, **k: 1 if re_cut and next(budgets) % 2
                        else len(survivals))
    monkeypatch.setattr(adaptive.calibration, "CALIBRATION_ROWS", float("inf"))  # nothing forgotten: exact counts
    graphs = {"enforce_eager": False, "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY",
                                                             "cudagraph_capture_sizes": [4, 8]}}
    llm = _llm(model_dir, graph_backends, **(graphs if torch.cuda.is_available() else {}), async_scheduling=True,
               speculative_config={"method": "dspark", "model": draft, "num_speculative_tokens": 3,
                                   "enable_adaptive_verification": True})
    verifier = llm.llm_engine.runner.adaptive_verifier
    if verifier.times is not None:  # (GPU) a host-bound step would keep its drafts without reading survivals
        verifier.times.overlapped = False
        # (GPU) a re-cut without first re-measuring the untrimmed step
        monkeypatch.setattr(adaptive.StepTimes, "stale", lambda self, *a: False)
        # (GPU) one request's budgets all pad to the 4-token graph, where the budget is never asked (can_trim)
        monkeypatch.setattr(verifier, "can_trim", lambda *a: True)
    seen = []
    observe = verifier.observe
    monkeypatch.setattr(verifier, "observe", lambda p, accepted: (seen.append(p), observe(p, accepted)))
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    stats, cal = llm.llm_engine.spec_decode_stats, verifier.calibration
    cal.fold()  # the outcomes still queued (they are folded in batches)
    assert stats.num_drafts >= 5 and cal.num_rows == stats.num_drafts == len(seen)
    scheduled = [3 if p.drafts is None else int(p.drafts[0]) for p in seen]  # (fewer near max_tokens)
    verified = [3 if p.verified() is None else int(p.verified()[0]) for p in seen]
    re_cuts = [p.device_lens is not None for p in seen]
    assert any(re_cuts) == re_cut and all(v == 1 for v, r in zip(verified, re_cuts) if r)
    assert all(v == s for v, s, r in zip(verified, scheduled, re_cuts) if not r)
    assert stats.num_unverified_draft_tokens == sum(scheduled) - sum(verified)
    assert cal.observed.tolist() == stats.num_accepted_tokens_per_pos
    slots = np.arange(3)[None, :] < np.array(verified)[:, None]
    assert cal.predicted == pytest.approx(np.where(slots, np.concatenate([p.survivals for p in seen]), 0).sum(0))
    assert (cal.predicted > 0).all() and np.all(np.diff(cal.predicted) <= 0)  # sums of running products
    llm.llm_engine.kv_cache_manager.assert_all_free()


def test_adaptive_verification_is_lossless_under_chunking_preemption_and_aborts(graph_backends, model_dir,
                                                                              tmp_path, monkeypatch):
    """Adaptive verification under async scheduling, every other all-verify step re-cut on the device to half
    its drafts (the budget is forced, so that both kinds of step meet the rest): chunked prefills, a cache too
    small for every request at once (preemption), then two requests aborted mid-run. Greedy output equals no
    speculation's, the steps calibrate, and no block is leaked."""
    from vllm.spec_decode import adaptive_verification as adaptive
    from vllm.tools.make_dspark_draft import write_dspark_draft
    draft = write_dspark_draft(tmp_path / "draft", target_dir=model_dir, seed=3)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(5, 250, (n,), generator=gen).tolist() for n in (9, 40, 17, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    want = [o.outputs[0].token_ids for o in _llm(model_dir, graph_backends).generate(batch, params, use_tqdm=False)]
    monkeypatch.setattr(adaptive.profile, "COST_PROFILE_REPEATS", 1)  # the interpreter: ~1 s per dummy step
    budgets = itertools.count()
    monkeypatch.setattr(adaptive.verifier, "choose_budget",
                        lambda survivals, *a, **k: len(survivals) // 2 if next(budgets) % 2 else len(survivals))
    monkeypatch.setattr(adaptive.StepTimes, "stale", lambda self, *a: False)  # (GPU) no untrimmed re-measures
    graphs = {"enforce_eager": False, "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY",
                                                             "cudagraph_capture_sizes": [4, 8]}}
    # 9 blocks of 16 tokens: the four requests need 11 at once (prompt, 12 tokens and 3 drafts each).
    llm = _llm(model_dir, graph_backends, **(graphs if torch.cuda.is_available() else {}), async_scheduling=True,
               max_num_batched_tokens=16, num_gpu_blocks_override=9,
               speculative_config={"method": "dspark", "model": draft, "num_speculative_tokens": 3,
                                   "enable_adaptive_verification": True})
    verifier = llm.llm_engine.runner.adaptive_verifier
    if verifier.times is not None:  # (GPU) a host-bound step would keep its drafts without asking the budget
        verifier.times.overlapped = False
    outs = llm.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    stats = llm.llm_engine.spec_decode_stats
    assert 0 < stats.num_unverified_draft_tokens < verifier.num_offered  # re-cut steps and whole ones
    verifier.calibration.fold()
    assert verifier.calibration.num_rows > 0
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    for _ in range(6):
        engine.step()
    engine.abort_request(["r1", "r2"])
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done == {"r0": want[0], "r3": want[3]}
    engine.kv_cache_manager.assert_all_free()


def test_a_step_scheduled_over_a_verify_step_in_flight_is_placed_on_the_device():
    """Async scheduling with device drafts: the host places each row after every draft in flight; the device
    takes the first token from the verified tokens, the drafts from the drafter, and moves the row back by the
    rejected drafts (positions, seq_lens, slot mapping, accepted counts)."""
    from vllm.config import SchedulerConfig
    from vllm.core.kv_cache_manager import KVCacheManager
    from vllm.core.request import Request
    from vllm.core.scheduler import Scheduler
    from vllm.core.sentinels import DEVICE_DRAFT_TOKEN_ID
    from vllm.worker.in_flight_fill import InFlightStep
    from vllm.worker.input_batch import InputBatch
    K, bs = 3, 4
    kv = KVCacheManager(64, bs, 1 + 2 * (1 + K), needs_blocks=True, needs_slots=True, slots_per_request=1 + K)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64), kv, K)
    reqs = [Request(r, list(range(5, 5 + n)), SamplingParams(max_tokens=20), 20, speculate=True)
            for r, n in (("a", 6), ("b", 9))]
    for r in reqs:
        sched.add_request(r)
    sched.update_from_output(sched.schedule(), {"a": [200], "b": [201]})
    batch = InputBatch(2, 32, 16, bs, torch.device("cpu"), slots_per_request=1 + K)
    for r in reqs:
        r.spec_token_ids = [DEVICE_DRAFT_TOKEN_ID] * K
    first = sched.schedule()  # a: [200 @ 6, 3 drafts], b: [201 @ 9, 3 drafts]
    batch.prepare(first, kv, InFlightStep(drafts=torch.tensor([[1, 2, 3], [4, 5, 6]]), draft_rows={"a": 0, "b": 1}))
    assert batch.input_ids.gpu[:8].tolist() == [200, 1, 2, 3, 201, 4, 5, 6]
    assert batch.draft_ids.gpu[:8].tolist() == [200, 1, 2, 3, 201, 4, 5, 6]
    for r in reqs:  # the first step is still in flight: its results are not back
        r.spec_token_ids = [DEVICE_DRAFT_TOKEN_ID] * K
    second = sched.schedule()
    assert [(s.num_computed_tokens, s.num_spec_in_flight) for s in second.scheduled] == [(10, 3), (13, 3)]
    # a kept one draft and emitted [1, 9]; b kept all three and emitted [4, 5, 6, 7].
    step = InFlightStep(verified=torch.tensor([[1, 9, -1, -1], [4, 5, 6, 7]]), verify_rows={"a": 0, "b": 1},
                        drafts=torch.tensor([[11, 12, 13], [14, 15, 16]]), draft_rows={"a": 0, "b": 1})
    common = batch.prepare(second, kv, step)
    assert batch.input_ids.gpu[:8].tolist() == [9, 11, 12, 13, 7, 14, 15, 16]
    positions = batch.positions.gpu[:8].tolist()
    assert positions == [8, 9, 10, 11, 13, 14, 15, 16]
    assert common.seq_lens.tolist() == [12, 17] and common.seq_lens_cpu.tolist() == [14, 17]
    assert common.num_accepted_tokens.tolist() == [2, 4]
    table = batch.block_table.gpu
    rows = [0] * 4 + [1] * 4
    assert common.slot_mapping.tolist() == [int(table[r, p // bs]) * bs + p % bs for r, p in zip(rows, positions)]
    sched.update_from_output(first, {"a": [1, 9], "b": [4, 5, 6, 7]})
    assert [(r.num_computed_tokens, r.num_spec_in_flight) for r in reqs] == [(12, 3), (17, 3)]
