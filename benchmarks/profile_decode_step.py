"""Where a decode step's time goes: torch.profiler tables (GPU kernels, host ops) over a few engine steps.

    python benchmarks/profile_decode_step.py --config benchmarks/configs/kimi-linear-1b3.json --batch-sizes 1,16

For FULL_DECODE_ONLY engines with and without async scheduling, and an eager one, on the same random
checkpoint: B requests with short prompts are prefilled and decoded a few steps, then `--steps` steps run under
the profiler. Prints the graph each step replayed, the kernels by GPU time, the host ops by CPU time, the host
synchronisations and copies per step, and the time per step over `--steps` back-to-back steps (one device sync
at the end, so overlapped host work is not counted twice). This is what showed the MoE
every-expert path putting ~2,300 small kernels into each decode graph (results/gpu/*profile_decode_step*).

`--prefill 1x256,5x256,32x256+32` profiles prefill steps instead: N prompts of L tokens in one step (beside D
requests' decode rows with +D), as the served load's waves bring them, on the served engine's defaults (graphs,
async scheduling, prefix caching unless --no-prefix-caching), then lists each step's wall and kernel time.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench_common import sync
from bench_offline_throughput import build_checkpoint
from bench_spec_and_graphs import make_llm
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from vllm import SamplingParams


# Runtime calls that make the host wait for the device (or queue copies): counted per step.
HOST_WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync",
              "cudaGraphLaunch")


def report(prof, steps: int, rows: int, device: str) -> None:
    """The profiler's tables (kernels by GPU time, host ops by CPU time) and per-step counts."""
    averages = prof.key_averages()
    for key in (("cuda_time_total",) if device == "cuda" else ()) + ("cpu_time_total",):
        print(averages.table(sort_by=key, row_limit=rows, max_name_column_width=60))
    calls = {e.key: e.count for e in averages}
    print("per step: " + ", ".join(f"{name} {calls.get(name, 0) / steps:.1f}" for name in HOST_WAITS), flush=True)
    # Device events are kernels, plus the copies and memsets queued between them.
    device_events = [e for e in averages if e.device_type == DeviceType.CUDA]
    kernels = [e for e in device_events if not e.key.startswith(("Memcpy", "Memset"))]
    if kernels:
        print(f"per step: {sum(e.count for e in kernels) / steps:.0f} kernels, "
              f"{sum(e.self_device_time_total for e in kernels) / steps / 1e3:.3f} ms of kernel time; "
              f"{sum(e.count for e in device_events if e not in kernels) / steps:.0f} copies/memsets", flush=True)
    return sum(e.self_device_time_total for e in kernels) / steps / 1e3 if kernels else None


def profile_prefill(llm, num_prompts: int, prompt_len: int, num_decode: int, rows: int, device: str) -> dict:
    """One step of `num_prompts` prompt chunks of `prompt_len` tokens (the served load's prefill wave) beside
    `num_decode` requests' decode rows, after the same step once unprofiled; its wall time is the median of 5 more."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    decoding = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    gen = torch.Generator().manual_seed(num_prompts)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    times = []
    name = f"{num_prompts}x{prompt_len}" + (f"+{num_decode}" if num_decode else "")
    for run in range(7):
        decoders = [f"decode{name}-{run}-{i}" for i in range(num_decode)]
        for rid in decoders:
            engine.add_request(rid, {"prompt_token_ids": torch.randint(3, engine.vocab_size, (16,),
                                                                        generator=gen).tolist()}, decoding)
        for _ in range(3 if decoders else 0):  # their prefill, then decode steps
            engine.step()
        for i in range(num_prompts):
            ids = torch.randint(3, engine.vocab_size, (prompt_len,), generator=gen).tolist()
            engine.add_request(f"prefill{name}-{run}-{i}", {"prompt_token_ids": ids}, params)
        sync(device)
        if run == 1:
            with profile(activities=activities) as prof:
                engine.step()
                sync(device)
        else:
            t0 = time.perf_counter()
            engine.step()
            sync(device)
            times.append(time.perf_counter() - t0)
        engine.abort_request(decoders)
        while engine.has_unfinished_requests():
            engine.step()
    print(f"=== prefill step: {num_prompts} x {prompt_len} tokens, {num_decode} decode rows")
    kernel_ms = report(prof, 1, rows, device)
    wall_ms = sorted(times[1:])[len(times[1:]) // 2] * 1e3
    print(f"step time {wall_ms:.2f} ms (median of 5 unprofiled steps)", flush=True)
    return {"shape": name, "step_ms": wall_ms, "kernel_ms": kernel_ms}


def profile_steps(llm, batch: int, steps: int, rows: int, device: str) -> None:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=8 * steps + 20, ignore_eos=True)
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):  # distinct prompts: identical rows would route every token to the same few experts
        ids = torch.randint(3, engine.vocab_size, (16,), generator=gen).tolist()
        engine.add_request(f"p{batch}-{i}", {"prompt_token_ids": ids}, params)
    for _ in range(8):  # prefill, then warm decode steps
        engine.step()
    runner, replayed = engine.runner, []
    pick = runner.graphs.graph_for
    runner.graphs.graph_for = lambda common: replayed.append(pick(common)) or replayed[-1]
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync(device)
    del runner.graphs.graph_for  # the class's method again
    print(f"=== batch {batch}: replayed {replayed[-1]}")
    report(prof, steps, rows, device)
    runs = []
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(device)
        runs.append((time.perf_counter() - t0) / steps)
    print(f"step time {sorted(runs)[len(runs) // 2] * 1e3:.2f} ms (median of 5 runs of {steps} back-to-back steps)",
          flush=True)
    while engine.has_unfinished_requests():
        engine.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="benchmarks/configs/kimi-linear-1b3.json")
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=12, help="rows per profiler table")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--modes", default="graphs_async,graphs_sync,eager",
                    help="engines to profile: graphs_async, graphs_sync, eager")
    ap.add_argument("--prefill", default=None, metavar="NxL",
                    help="profile one prefill step of N prompts of L tokens instead, for each NxL of a comma-separated "
                         "list (default engine: graphs, async)")
    ap.add_argument("--no-prefix-caching", action="store_true", help="with --prefill: prefix caching off")
    args = ap.parse_args()
    path = Path(tempfile.mkdtemp(prefix="profile_decode_"))
    build_checkpoint(argparse.Namespace(config=args.config, device=args.device, dtype=args.dtype, seed=0), path)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    engine_args = argparse.Namespace(dtype=args.dtype, device=args.device, seed=0, prompt_len=16,
                                     output_len=8 * args.steps + 20, num_spec=0,
                                     gpu_memory_utilization=args.gpu_memory_utilization)
    if args.prefill:
        shapes = []  # (prompts, tokens each, decode rows) from NxL or NxL+D
        for shape in args.prefill.split(","):
            nl, _, d = shape.partition("+")
            n, length = (int(v) for v in nl.split("x"))
            shapes.append((n, length, int(d or 0)))
        engine_args.prompt_len, engine_args.output_len = max(length for _, length, _ in shapes), 64
        # The served engine's defaults (compilation mode included), with a step large enough for every shape.
        llm = make_llm(engine_args, path, True, None, max(n + d for n, _, d in shapes), compilation_config=None,
                       enable_prefix_caching=not args.no_prefix_caching,
                       max_num_batched_tokens=max(8192, *(n * length + d for n, length, d in shapes)))
        results = [profile_prefill(llm, n, length, d, args.rows, args.device) for n, length, d in shapes]
        for r in results:
            kernels = "" if r["kernel_ms"] is None else f", {r['kernel_ms']:.2f} ms of kernels"
            print(f"prefill {r['shape']:>12}: step {r['step_ms']:.2f} ms{kernels}")
        return
    modes = {"graphs_async": (True, True), "graphs_sync": (True, False), "eager": (False, True)}
    for graphs, overlap in (modes[m] for m in args.modes.split(",")):
        print(f"##### {'FULL_DECODE_ONLY graphs' if graphs else 'eager'}, "
              f"{'async scheduling' if overlap else 'synchronous'}")
        llm = make_llm(engine_args, path, graphs, None, max(batches), async_scheduling=overlap)
        for b in batches:
            profile_steps(llm, b, args.steps, args.rows, args.device)
        del llm


if __name__ == "__main__":
    main()
