"""InputBatch's continuing-decode path (a step of the same one-token decodes as the step before writes only what
moved) leaves every device input exactly as the full per-request rewrite does, step by step: through block
boundaries, requests finishing and arriving, chunked prompts, preemption, with and without async scheduling."""
from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.worker.input_batch import InputBatch

BASE = dict(max_model_len=256, dtype="float32", max_num_batched_tokens=48, block_size=16)


def _record(monkeypatch, continuing: bool):
    """Patches InputBatch.prepare to snapshot the device inputs the step's kernels read, and (for the full-rewrite
    run) to refuse the continuing path; returns (snapshots, count of continuing steps)."""
    snapshots, taken = [], {"n": 0}
    prepare, decide = InputBatch.prepare, InputBatch._continues_decode

    def continues(self, *args):
        ok = decide(self, *args) if continuing else False
        taken["n"] += ok
        return ok

    def recorded(self, out, kv, in_flight=None):
        common = prepare(self, out, kv, in_flight)
        n, T = common.num_reqs, common.num_actual_tokens
        snapshots.append({
            "query_start_loc": self.query_start_loc.gpu[:n + 1].clone(), "seq_lens": self.seq_lens.gpu[:n].clone(),
            "state_indices": self.state_indices.gpu[:n].clone(), "input_ids": self.input_ids.gpu[:T].clone(),
            "positions": self.positions.gpu[:T].clone(), "slot_mapping": self.slot_mapping.gpu[:T].clone(),
            # Only the entries a row's tokens can reach: columns past them may hold a finished request's blocks.
            "blocks": [self.block_table.gpu[r, :(int(common.seq_lens_cpu[r]) + 15) // 16].clone() for r in range(n)],
            "is_prefilling": common.is_prefilling.clone(), "query_start_loc_cpu": common.query_start_loc_cpu.clone(),
            "max_query_len": common.max_query_len, "max_seq_len": common.max_seq_len})
        return common
    monkeypatch.setattr(InputBatch, "_continues_decode", continues)
    monkeypatch.setattr(InputBatch, "prepare", recorded)
    return snapshots, taken


def _run(async_scheduling: bool, **kwargs):
    llm = LLM(**BASE, async_scheduling=async_scheduling, **kwargs)
    gen = torch.Generator().manual_seed(0)
    engine = llm.llm_engine
    # Staggered lengths and budgets: rows finish at different steps, late requests join mid-decode, and the
    # 48-token budget chunks the long prompts into mixed steps.
    lengths, max_tokens = [5, 40, 1, 77, 16, 23, 9], [30, 12, 40, 20, 33, 7, 25]
    for i, (n, m) in enumerate(zip(lengths, max_tokens)):
        engine.add_request(f"r{i}", torch.randint(5, 512, (n,), generator=gen).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
    preempted = []
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda req: preempted.append(req.request_id) or preempt(req)
    outputs, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 15:  # arrives while the others decode
            engine.add_request("late", torch.randint(5, 512, (50,), generator=gen).tolist(),
                               SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    engine.kv_cache_manager.assert_all_free()
    return outputs, len(preempted)


def _assert_same(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        for key in w:
            a, b = g[key], w[key]
            same = all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == len(b) if isinstance(b, list) \
                else (torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b)
            assert same, f"step {step}: {key} differs: {a} against {b}"


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("num_gpu_blocks", [None, 16], ids=["roomy", "preempting"])
def test_continuing_steps_write_what_a_full_rewrite_writes(monkeypatch, async_scheduling, num_gpu_blocks):
    kwargs = {} if num_gpu_blocks is None else {"num_gpu_blocks_override": num_gpu_blocks}
    want_steps, none = _record(monkeypatch, continuing=False)
    want, want_preempted = _run(async_scheduling, **kwargs)
    monkeypatch.undo()
    got_steps, taken = _record(monkeypatch, continuing=True)
    got, preempted = _run(async_scheduling, **kwargs)
    assert none["n"] == 0 and taken["n"] > 20, "the continuing path ran on most decode steps"
    assert (preempted > 0) == (num_gpu_blocks is not None) and preempted == want_preempted
    assert got == want
    _assert_same(got_steps, want_steps)
