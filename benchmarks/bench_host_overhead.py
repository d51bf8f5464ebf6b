"""Host time per engine step spent scheduling and preparing inputs, versus the number of running decodes.

    python benchmarks/bench_host_overhead.py --device cpu --out benchmarks/results/cpu/host_overhead_cpu.json
    python benchmarks/bench_host_overhead.py --device cuda --out benchmarks/results/gpu/host_overhead_cuda.json

For each N, N requests (short random prompts, ignore_eos, max_tokens up to max_model_len) are added to one
LLMEngine and stepped until all decode; then `--iters` real `engine.step()` calls are timed. The engine runs
unmodified: `Scheduler.schedule`, `InputBatch.prepare` and `ModelRunner._attn_metadata` (plus the engine's
sampling-metadata build, reported apart) are wrapped on the instances with perf_counter, so "host prep" is the
host time of exactly those calls inside real steps, without the forward. The full step (forward, sampling,
output processing) is timed too for context. Host times are not synchronized with the GPU: they are what the
CPU spends before the forward can be issued. Writes JSON (raw per-step timings) and a PNG next to it.
"""
from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from bench_common import metadata, set_threads, stats, write_json

from vllm.assets import DEFAULT_MODEL_DIR
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.llm_engine import LLMEngine
from vllm.sampling_params import SamplingParams

PARTS = ("schedule", "prepare", "attn_metadata", "sampling_metadata")


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


def measure(engine: LLMEngine, timer: StepTimer, n: int, args) -> dict:
    rng = random.Random(n)
    vocab = engine.vocab_size
    max_tokens = args.max_model_len - args.prompt_len
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"n{n}-{i}", [rng.randrange(3, vocab) for _ in range(args.prompt_len)], params)
    for _ in range(1 + args.warmup):  # one prefill step (the whole batch fits the token budget), then warm-up
        engine.step()
    raw = {k: [] for k in (*PARTS, "host_prep", "step")}
    for _ in range(args.iters):
        timer.reset()
        t0 = time.perf_counter()
        engine.step()
        step = time.perf_counter() - t0
        sched = timer.last_sched.scheduled
        if len(sched) != n or any(s.is_prefilling or s.num_tokens != 1 for s in sched):
            raise RuntimeError(f"N={n}: expected {n} pure decode rows, got {len(sched)} (preemption or prefill)")
        timer.t["host_prep"] = timer.t["schedule"] + timer.t["prepare"] + timer.t["attn_metadata"]
        timer.t["step"] = step
        for k, xs in raw.items():
            xs.append(round(timer.t[k] * 1e6, 2))
    engine.abort_request([f"n{n}-{i}" for i in range(n)])
    assert not engine.has_unfinished_requests()
    return {"num_running": n, "us": {k: stats(v) for k, v in raw.items()}, "raw_us": raw}


def plot(results: list[dict], meta: dict, png: str) -> None:
    ns = [r["num_running"] for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5.6))
    for key, label, style in (("host_prep", "host prep total (schedule + prepare + attn meta)", "o-"),
                              ("schedule", "Scheduler.schedule", "s--"), ("prepare", "InputBatch.prepare", "^--"),
                              ("attn_metadata", "attention metadata build", "v--"),
                              ("sampling_metadata", "sampling metadata (not in total)", "x:")):
        med = [r["us"][key]["median"] for r in results]
        p90 = [r["us"][key]["p90"] for r in results]
        line, = ax1.plot(ns, med, style, label=label)
        if key == "host_prep":
            ax1.fill_between(ns, med, p90, color=line.get_color(), alpha=0.2, label="host prep median..p90")
    ax1.axhline(1000, color="red", lw=0.8, ls=":", label="1 ms (DESIGN.md target: well under)")
    ax1.set(xscale="log", yscale="log", xlabel="running decode requests", ylabel="host time per step (us)",
            title="Host step preparation (median)")
    ax1.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
    step = [r["us"]["step"]["median"] / 1e3 for r in results]
    share = [100 * r["us"]["host_prep"]["median"] / r["us"]["step"]["median"] for r in results]
    ax2.plot(ns, step, "o-", color="black", label="full engine.step (median)")
    ax2.set(xscale="log", xlabel="running decode requests", ylabel="full step time (ms)",
            title="Full step and host-prep share")
    ax3 = ax2.twinx()
    ax3.plot(ns, share, "s--", color="tab:orange", label="host prep share of step (%)")
    ax3.set(ylabel="host prep / step (%)", ylim=(0, 1.2 * max(share)))
    lines = ax2.get_lines() + ax3.get_lines()
    ax2.legend(lines, [ln.get_label() for ln in lines], fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15),
               ncol=2)
    for ax in (ax1, ax2):
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.grid(alpha=0.3)
    fig.suptitle(f"{meta['device_name']} ({meta['device']}), commit {meta['git_commit'][:12]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="model dir (default: built-in tiny K3)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-running", default="1,4,16,64,128,256", help="comma-separated request counts")
    ap.add_argument("--iters", type=int, default=200, help="timed steps per count")
    ap.add_argument("--warmup", type=int, default=10, help="untimed decode steps per count")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="default: 512 MiB on CPU")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default); see "
                    "bench_common.set_threads")
    ap.add_argument("--out", default="benchmarks/results/cpu/host_overhead_cpu.json")
    args = ap.parse_args()
    set_threads(args.threads)
    meta = metadata(args.device)  # at the start: the commit that was measured, not whatever landed meanwhile
    counts = [int(x) for x in args.num_running.split(",")]
    if 1 + args.warmup + args.iters >= args.max_model_len - args.prompt_len:
        raise SystemExit("--warmup + --iters must stay below --max-model-len - --prompt-len (requests would end)")
    kv_bytes = args.kv_cache_memory_bytes or (512 << 20 if args.device == "cpu" else None)
    engine_args = EngineArgs(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=max(counts),
                             max_num_batched_tokens=8192, max_model_len=args.max_model_len,
                             kv_cache_memory_bytes=kv_bytes, enforce_eager=args.enforce_eager)
    engine = LLMEngine.from_engine_args(engine_args)
    timer = StepTimer()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.runner.input_batch, "prepare", "prepare")
    timer.wrap(engine.runner, "_attn_metadata", "attn_metadata")
    timer.wrap(engine, "_sampling_metadata", "sampling_metadata")
    results = []
    print(f"{'N':>5} {'host prep med':>14} {'p90':>9} {'schedule':>9} {'prepare':>9} {'attn md':>8} "
          f"{'sampl md':>9} {'step med':>10}   (us)")
    for n in counts:
        r = measure(engine, timer, n, args)
        results.append(r)
        u = r["us"]
        print(f"{n:>5} {u['host_prep']['median']:>14.1f} {u['host_prep']['p90']:>9.1f} "
              f"{u['schedule']['median']:>9.1f} {u['prepare']['median']:>9.1f} {u['attn_metadata']['median']:>8.1f} "
              f"{u['sampling_metadata']['median']:>9.1f} {u['step']['median']:>10.1f}", flush=True)
    config = {**vars(args), "engine_args": vars(engine_args), "dtype_resolved": str(engine.config.model_config.dtype)}
    path = write_json(args.out, {**meta, "benchmark": "host_overhead", "config": config, "results": results})
    plot(results, meta, str(path.with_suffix(".png")))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
