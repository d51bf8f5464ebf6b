"""Host time per engine step spent scheduling and preparing inputs, versus the number of running decodes.

    python benchmarks/bench_host_overhead.py --device cpu --out benchmarks/results/cpu/host_overhead_cpu.json
    python benchmarks/bench_host_overhead.py --device cuda --out benchmarks/results/gpu/host_overhead_cuda.json
    python benchmarks/bench_host_overhead.py --num-running 16,64,256 --context-lens 4096,32768 --stub-model \
        --penalty --out benchmarks/results/cpu/host_overhead_long_cpu.json

For each N, N requests (random prompts, ignore_eos, enough max_tokens for the timed steps) are added to one
LLMEngine and stepped until all decode; then `--iters` real `engine.step()` calls are timed. The engine runs
unmodified: `Scheduler.schedule`, `InputBatch.prepare` and `ModelRunner._attn_metadata` (plus the worker's
sampling-metadata build, reported apart) are wrapped on the instances with perf_counter, so "host prep" is the
host time of exactly those calls inside real steps, without the forward. The full step (forward, sampling,
output processing) is timed too for context. Host times are not synchronized with the GPU: they are what the
CPU spends before the forward can be issued. Writes JSON (raw per-step timings) and a PNG next to it.

Long contexts: `--context-lens` gives each request a prompt of that many tokens (past the built-in model's
4096-token limit a tiny random K3 that takes them is written to a temp dir). `--stub-model` replaces the
model's forward by zeros of the right shape, so prefilling 256 x 32K tokens takes seconds, not hours, and the
timed steps measure the host alone (the engine's own code is unchanged). `--penalty` gives every request a
repetition penalty (the sampler's per-request context then matters). `--full-rewrite` makes InputBatch
rewrite every row each step, the peer of its continuing-decode path. Requests take FINAL_ONLY outputs, as
LLM.generate does; the output processor's time is reported as "outputs", the sampler's (penalties, filters,
the draw) as "sample". `--served` makes them stream as `vllm serve` runs them in bench_serve_sweep.py (DELTA
outputs, the sampled token's logprob) and adds what the engine core process does with a step's outputs before
they reach its pipe (`pack_outputs`, pickling) as "serialize", timed after each step. `--freeze-gc` freezes the
heap once the engine is built, as the engine core process does (`vllm.utils.freeze_gc_heap`); compare the
step's mean with its median to see what garbage collections cost without it.
"""
from __future__ import annotations

import argparse
import pickle
import random
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from bench_common import metadata, set_threads, stats, write_json

from vllm.assets import DEFAULT_MODEL_DIR, TINY_TOKENIZER_DIR
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.llm_engine import LLMEngine
from vllm.engine.serial_utils import pack_outputs
from vllm.model_executor.model_loader import load_config
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.tools.make_tiny_model import write_tiny_model
from vllm.utils import freeze_gc_heap

PARTS = ("schedule", "prepare", "attn_metadata", "sampling_metadata", "sample", "outputs", "serialize")


class StepTimer:
    """Accumulates the host time of wrapped instance methods over one step."""

    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)
        self.last_sched = None

    def wrap(self, obj, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                self.t[key] += time.perf_counter() - t0
            if key == "schedule":
                self.last_sched = out
            return out
        setattr(obj, name, timed)  # instance attribute: shadows the method for this object only

    def reset(self) -> None:
        self.t.clear()
        self.last_sched = None


def measure(engine: LLMEngine, timer: StepTimer, n: int, context: int, args) -> dict:
    rng = random.Random(n)
    vocab = engine.vocab_size
    max_tokens = engine.config.scheduler_config.max_model_len - context  # outlives the staggered prefill
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            repetition_penalty=1.1 if args.penalty else 1.0, logprobs=0 if args.served else None,
                            output_kind=RequestOutputKind.DELTA if args.served else RequestOutputKind.FINAL_ONLY)
    for i in range(n):
        engine.add_request(f"n{n}-{i}", [rng.randrange(3, vocab) for _ in range(context)], params)
    while any(r.is_prefilling or r.status.value == "waiting" for r in engine.scheduler.requests.values()):
        engine.step()  # the prefill, in as many steps as the token budget takes
    for _ in range(args.warmup):
        engine.step()
    raw = {k: [] for k in (*PARTS, "host_prep", "step")}
    for _ in range(args.iters):
        timer.reset()
        t0 = time.perf_counter()
        outputs = engine.step()
        step = time.perf_counter() - t0
        t0 = time.perf_counter()
        pickle.dumps(pack_outputs(outputs))
        timer.t["serialize"] = time.perf_counter() - t0
        sched = timer.last_sched.scheduled
        if len(sched) != n or any(s.is_prefilling or s.num_tokens != 1 for s in sched):
            raise RuntimeError(f"N={n}: expected {n} pure decode rows, got {len(sched)} (preemption or prefill)")
        timer.t["host_prep"] = timer.t["schedule"] + timer.t["prepare"] + timer.t["attn_metadata"]
        timer.t["step"] = step
        for k, xs in raw.items():
            xs.append(round(timer.t[k] * 1e6, 2))
    engine.abort_request([f"n{n}-{i}" for i in range(n)])
    while engine.has_unfinished_requests():  # with async scheduling a step is still in flight: drain it
        engine.step()
    engine.kv_cache_manager.assert_all_free()
    return {"num_running": n, "context_len": context, "us": {k: stats(v) for k, v in raw.items()}, "raw_us": raw}


def plot(results: list[dict], meta: dict, png: str) -> None:
    contexts = sorted({r["context_len"] for r in results})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5.6))
    for c in contexts:
        rows = [r for r in results if r["context_len"] == c]
        ns = [r["num_running"] for r in rows]
        ax1.plot(ns, [r["us"]["host_prep"]["median"] for r in rows], "o-", label=f"host prep, context {c}")
        ax2.plot(ns, [r["us"]["step"]["median"] / 1e3 for r in rows], "o-", label=f"full step, context {c}")
    rows = [r for r in results if r["context_len"] == contexts[-1]]
    ns = [r["num_running"] for r in rows]
    for key, style in (("schedule", "s--"), ("prepare", "^--"), ("attn_metadata", "v--"),
                       ("sampling_metadata", "x:"), ("outputs", "d:")):
        ax1.plot(ns, [r["us"][key]["median"] for r in rows], style, label=f"{key}, context {contexts[-1]}")
    ax1.axhline(1000, color="red", lw=0.8, ls=":", label="1 ms")
    ax1.set(xscale="log", yscale="log", xlabel="running decode requests", ylabel="host time per step (us)",
            title="Host step preparation (median; host prep = schedule + prepare + attn metadata)")
    ax2.set(xscale="log", xlabel="running decode requests", ylabel="full step time (ms)", title="Full engine.step")
    for ax in (ax1, ax2):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{meta['device_name']} ({meta['device']}), commit {meta['git_commit'][:12]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="model dir (default: the built-in K3)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-running", default="1,4,16,64,128,256", help="comma-separated request counts")
    ap.add_argument("--iters", type=int, default=200, help="timed steps per count")
    ap.add_argument("--warmup", type=int, default=10, help="untimed decode steps per count")
    ap.add_argument("--context-lens", default="16", help="comma-separated prompt (context) lengths")
    ap.add_argument("--stub-model", action="store_true", help="zeros instead of the model's forward (host only)")
    ap.add_argument("--penalty", action="store_true", help="every request uses repetition_penalty=1.1")
    ap.add_argument("--served", action="store_true", help="DELTA outputs with logprobs, plus their serialization")
    ap.add_argument("--freeze-gc", action="store_true", help="freeze the heap after start-up, as the core does")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--full-rewrite", action="store_true",
                    help="refuse InputBatch's continuing-decode path (the A/B peer of that path)")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="default: 512 MiB on CPU")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default); see "
                    "bench_common.set_threads")
    ap.add_argument("--out", default="benchmarks/results/cpu/host_overhead_cpu.json")
    args = ap.parse_args()
    set_threads(args.threads)
    meta = metadata(args.device)  # at the start: the commit that was measured, not whatever landed meanwhile
    counts = [int(x) for x in args.num_running.split(",")]
    contexts = [int(x) for x in args.context_lens.split(",")]
    # Requests that finish their prefill first decode while the others prefill: room for all those tokens.
    max_model_len = max(contexts) + -(-max(counts) * max(contexts) // 8192) + args.warmup + args.iters + 16
    # On CPU, room for every request's whole context (the tiny models' latent cache takes 320 bytes a token).
    kv_bytes = args.kv_cache_memory_bytes or (max(512 << 20, max(counts) * max_model_len * 1024)
                                              if args.device == "cpu" else None)
    model = args.model
    if max_model_len > load_config(model).max_position_embeddings:  # a tiny K3 that takes such contexts
        model = write_tiny_model(Path(tempfile.mkdtemp(prefix="bench_host_")), "k3",
                                 max_position_embeddings=max_model_len)
    engine_args = EngineArgs(model=model, tokenizer=str(TINY_TOKENIZER_DIR), device=args.device, dtype=args.dtype,
                             max_num_seqs=max(counts),
                             max_num_batched_tokens=8192, max_model_len=max_model_len,
                             kv_cache_memory_bytes=kv_bytes, enforce_eager=args.enforce_eager)
    engine = LLMEngine.from_engine_args(engine_args)
    if args.stub_model:
        hidden = engine.config.model_config.hf_config.hidden_size
        runner = engine.runner
        runner.model.forward = lambda ids, positions, meta: torch.zeros(ids.shape[0], hidden, dtype=runner.dtype,
                                                                        device=runner.device)
    if args.full_rewrite:
        engine.runner.input_batch._continues_decode = lambda *a: False  # instance attribute: this engine only
    if args.freeze_gc:
        freeze_gc_heap()
    timer = StepTimer()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.runner.input_batch, "prepare", "prepare")
    timer.wrap(engine.runner, "_attn_metadata", "attn_metadata")
    timer.wrap(engine.runner.sampling, "metadata", "sampling_metadata")
    timer.wrap(engine.output_processor, "process", "outputs")
    timer.wrap(engine.runner.sample_step, "sampler", "sample")
    results = []
    print(f"{'N':>5} x {'ctx':>6} {'host prep med':>14} {'p90':>9} {'schedule':>9} {'prepare':>9} {'attn md':>8} "
          f"{'sampl md':>9} {'sample':>8} {'outputs':>8} {'serialize':>9} {'step med':>10} {'step mean':>10}   (us)")
    for context in contexts:
        for n in counts:
            r = measure(engine, timer, n, context, args)
            results.append(r)
            u = r["us"]
            print(f"{n:>5} x {context:>6} {u['host_prep']['median']:>14.1f} {u['host_prep']['p90']:>9.1f} "
                  f"{u['schedule']['median']:>9.1f} {u['prepare']['median']:>9.1f} "
                  f"{u['attn_metadata']['median']:>8.1f} {u['sampling_metadata']['median']:>9.1f} "
                  f"{u['sample']['median']:>8.1f} {u['outputs']['median']:>8.1f} {u['serialize']['median']:>9.1f} "
                  f"{u['step']['median']:>10.1f} {u['step']['mean']:>10.1f}",
                  flush=True)
    config = {**vars(args), "engine_args": vars(engine_args), "dtype_resolved": str(engine.config.model_config.dtype)}
    path = write_json(args.out, {**meta, "benchmark": "host_overhead", "config": config, "results": results})
    plot(results, meta, str(path.with_suffix(".png")))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
