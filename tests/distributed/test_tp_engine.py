"""The engine over 2 tensor-parallel ranks (gloo, CPU processes): greedy outputs equal one rank's with async
scheduling, chunked prefill, prefix caching, expert parallelism and ngram speculation; a rank that dies fails the
engine naming it, within a bounded time; no rank outlives its engine; two "nodes" of one rank each meet through
the rendezvous flags on localhost; sizes that do not divide are refused naming both numbers."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.assets import DEFAULT_DSPARK_DIR

BASE = dict(max_model_len=256, dtype="float32", max_num_batched_tokens=48, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LENGTHS = [5, 40, 77, 9]  # 77: a prompt in two chunks


def prompts(lengths=LENGTHS, seed=0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(5, 2000, (n,), generator=gen).tolist()} for n in lengths]


def tokens(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def tp_workers_alive() -> list[int]:
    """Processes of ours still running vllm.executor.tp_worker."""
    out = subprocess.run(["pgrep", "-f", "vllm.executor.tp_worker"], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def two_turns(llm: LLM) -> list[list[int]]:
    """A conversation's turn, then the next one (its prompt the first's prompt and answer, then more)."""
    first = prompts([40, 77], seed=1)
    answers = tokens(llm.generate(first, GREEDY, use_tqdm=False))
    second = [{"prompt_token_ids": p["prompt_token_ids"] + a + [7, 8, 9]} for p, a in zip(first, answers)]
    return answers + tokens(llm.generate(second, GREEDY, use_tqdm=False))


def structured(llm: LLM) -> list[tuple[list[int], str]]:
    so = [{"regex": "[0-9]{3}-[a-z]{2,4}"}, {"choice": ["yes", "no"]}]
    params = [SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=s) for s in so] + [GREEDY]
    return [(c.token_ids, c.text) for o in llm.generate(prompts([5, 9, 12], seed=4), params, use_tqdm=False)
            for c in o.outputs]


@pytest.fixture(scope="module")
def reference() -> dict[str, list[list[int]]]:
    """One rank's outputs, computed before any tensor-parallel engine joins this process to a group."""
    llm = LLM(**BASE, async_scheduling=True)
    plain = tokens(llm.generate(prompts(), GREEDY, use_tqdm=False))
    repeated = two_turns(llm)
    ngram = LLM(**BASE, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                            "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    spec = tokens(ngram.generate(prompts(seed=2), GREEDY, use_tqdm=False))
    return {"plain": plain, "repeated": repeated, "ngram": spec,
            "dspark": tokens(llm.generate(prompts(seed=3), GREEDY, use_tqdm=False)), "structured": structured(llm)}


@pytest.fixture
def make_tp(monkeypatch):
    """Builds tensor-parallel LLMs; each is shut down after the test, whatever happened."""
    monkeypatch.setenv("VLLM_TP_TIMEOUT_S", "30")
    made = []

    def make(**kwargs) -> LLM:
        made.append(LLM(**{**BASE, "tensor_parallel_size": 2, **kwargs}))
        return made[-1]
    yield make
    for llm in made:
        llm.llm_engine.shutdown()
    deadline = time.monotonic() + 10
    while tp_workers_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not tp_workers_alive(), "a tensor-parallel rank outlived its engine"


def test_two_ranks_give_one_ranks_outputs(reference, make_tp):
    llm = make_tp(async_scheduling=True)
    assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == reference["plain"]
    # The second turn of each conversation finds the first one cached, on every rank alike.
    assert two_turns(llm) == reference["repeated"]
    engine = llm.llm_engine
    assert engine.scheduler.prefix_cache_hits > 0
    engine.kv_cache_manager.assert_all_free()


def test_expert_parallel_ranks_give_one_ranks_outputs(reference, make_tp):
    llm = make_tp(async_scheduling=True, enable_expert_parallel=True)
    assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == reference["plain"]


def test_ngram_speculation_under_tensor_parallelism(reference, make_tp):
    llm = make_tp(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                      "prompt_lookup_max": 3})
    assert tokens(llm.generate(prompts(seed=2), GREEDY, use_tqdm=False)) == reference["ngram"]
    assert llm.llm_engine.spec_decode_stats.num_draft_tokens > 0


def test_a_killed_rank_fails_the_engine_naming_it(make_tp):
    llm = make_tp()
    engine = llm.llm_engine
    (worker,) = engine.workers.values()
    worker.kill()
    worker.wait()
    start = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        llm.generate(prompts([8]), GREEDY, use_tqdm=False)
    assert "rank 1" in str(e.value) and f"pid {worker.pid}" in str(e.value)
    assert time.monotonic() - start < 30


def test_sizes_that_do_not_divide_are_refused():
    with pytest.raises(ValueError) as e:
        LLM(**BASE, tensor_parallel_size=3)
    assert "--tensor-parallel-size 3 must divide the model's kda_num_heads=4" in str(e.value)
    with pytest.raises(ValueError) as e:
        LLM(**BASE, tensor_parallel_size=2, nnodes=3)
    assert "--nnodes" in str(e.value) and "divides --tensor-parallel-size (2)" in str(e.value)
    assert not tp_workers_alive()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_of_one_rank_each(reference, make_tp):
    port = _port()
    node1 = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--headless", "-tp", "2",
                              "--nnodes", "2", "--node-rank", "1", "--master-port", str(port), "--max-model-len",
                              "256", "--dtype", "float32", "--max-num-batched-tokens", "48", "--max-num-seqs", "8"])
    try:
        llm = make_tp(nnodes=2, node_rank=0, master_port=port)
        assert not llm.llm_engine.workers  # node 0 runs rank 0 only
        assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == reference["plain"]
        llm.llm_engine.shutdown()
        assert node1.wait(30) == 0
    finally:
        if node1.poll() is None:
            node1.kill()


def test_no_rank_outlives_a_killed_engine():
    """SIGKILL leaves rank 0 no chance to stop the others: they notice their parent is gone and exit."""
    code = ("from vllm import LLM; llm = LLM(tensor_parallel_size=2, max_model_len=256, dtype='float32'); "
            "print('ready', flush=True); import time; time.sleep(600)")
    engine = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        for line in engine.stdout:
            if line.strip() == "ready":
                break
        assert tp_workers_alive()
    finally:
        engine.kill()
        engine.wait()
    deadline = time.monotonic() + 10
    while tp_workers_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not tp_workers_alive()


def test_a_stuck_rank_fails_the_engine_within_the_timeout(make_tp, monkeypatch):
    monkeypatch.setenv("VLLM_TP_TIMEOUT_S", "5")
    llm = make_tp()
    (worker,) = llm.llm_engine.workers.values()
    os.kill(worker.pid, signal.SIGSTOP)  # alive, but answers nothing
    start = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        llm.generate(prompts([8]), GREEDY, use_tqdm=False)
    assert "did not answer within 5 s" in str(e.value)
    assert time.monotonic() - start < 20


DSPARK = {"method": "dspark", "model": str(DEFAULT_DSPARK_DIR), "num_speculative_tokens": 3}


def test_dspark_under_tensor_parallelism(reference, make_tp):
    """DSpark drafts (the draft whole on every rank, over the gathered vocabulary): the greedy outputs of one rank
    without speculation. (Adaptive verification needs graph-capable backends, which run on GPUs only.)"""
    llm = make_tp(async_scheduling=True, speculative_config=DSPARK)
    assert tokens(llm.generate(prompts(seed=3), GREEDY, use_tqdm=False)) == reference["dspark"]
    stats = llm.llm_engine.spec_decode_stats
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens


def test_structured_outputs_under_tensor_parallelism(reference, make_tp):
    """Grammars compile at admission on every rank (a background compile would finish in different steps on
    different ranks); the constrained outputs are one rank's."""
    got = structured(make_tp())
    assert got[0][1][:3].isdigit() and got[1][1] in ("yes", "no")
    assert got == reference["structured"]
