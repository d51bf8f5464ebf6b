"""Where a speculative decode step's time goes on the built-in model: host by Python function (cProfile), device
by kernel (torch.profiler), for one request (or `--concurrency` requests, submitted together) generating greedily.

    python benchmarks/profile_spec_step.py --spec '{"method": "dspark", "num_speculative_tokens": 3}'

Prints the wall time per generated token (median of `--repeats`, unprofiled; with adaptive verification, the
drafts its budget kept and the step times it weighed), the host time per step in each phase
of the engine loop (timers around its functions, one timed run), then the top functions by own and by cumulative
host time, then the device timeline between marks in the step (where the device waits for the host), then the
top CUDA kernels by device time and the number of kernel launches per step, then each graph's device time per
replay (the target's forward and the draft's step, without the host).
A dspark config without "model" gets the shipped draft.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import io
import itertools
import json
import pstats
import time
from collections.abc import Callable

import torch
from bench_common import device_us_per_call, sync
from torch.profiler import ProfilerActivity, profile

from vllm import LLM, SamplingParams
from vllm.assets import DEFAULT_DSPARK_DIR
from vllm.tools.prepare_corpus import heldout_code_windows
from vllm.worker.model_runner import AsyncModelRunnerOutput


def count_step_paths(runner) -> tuple[collections.Counter, set]:
    """Counts how the runner's forwards run (graph replay by shape, piecewise, eager), to tell a step that
    misses its graph from one that is slow inside it; also returns the set of graph keys replayed (the target's
    and the draft's)."""
    paths, replayed = collections.Counter(), set()

    def counted(name, fn):
        def wrapper(*a, **kw):
            paths[name(*a)] += 1
            return fn(*a, **kw)
        return wrapper

    graphs = runner.graphs
    if graphs.captured is not None:
        graphs.captured.replay = counted(lambda key: replayed.add(key) or f"graph {key}", graphs.captured.replay)
    graphs.forward = counted(lambda T, common: "eager", graphs.forward)  # the eager path of a step
    if graphs.piecewise is not None:
        graphs.piecewise.run = counted(lambda T, meta: "piecewise", graphs.piecewise.run)
    return paths, replayed


def time_graph_replays(graphs, keys, repeats: int = 200) -> dict[str, float]:
    """Device microseconds per replay of each graph in `keys`, back to back between two CUDA events: the device
    floor of that part of a step, without the host. Run it last: a replay rewrites the cache rows and recurrent
    states of the last step's rows."""
    return {str(key): device_us_per_call(functools.partial(graphs.replay, key), "cuda", repeats, rounds=1)
            for key in sorted(keys, key=str)}


# (owner path from the engine, method): the engine loop's phases, timed per step; nested phases are inside their
# parents' times (execute_model holds prepare, replay, verify and draft; process_step holds the rest).
PHASES = [("scheduler", "schedule"), ("runner", "execute_model"), ("runner.sampling", "metadata"),
          ("runner.input_batch", "prepare"), ("runner.graphs", "graph_for"), ("runner.graphs.captured", "replay"),
          ("runner.sample_step", "_verify"), ("runner.drafting", "draft_on_device"), ("", "_process_step"),
          ("scheduler", "update_from_output"), ("output_processor", "process"), ("runner", "propose_drafts")]


def patch_engine(engine, methods: list[tuple[str, str]], wrap, wrap_get_output) -> Callable[[], None]:
    """Replaces each (owner path from the engine, method) by wrap(label, original) on its owner, and
    AsyncModelRunnerOutput.get_output by wrap_get_output(original); returns a function that restores them."""
    restore = []
    for path, method in methods:
        owner = functools.reduce(getattr, path.split("."), engine) if path else engine
        if owner is None:
            continue
        restore.append((owner, method, owner.__dict__.get(method)))
        setattr(owner, method, wrap(f"{path + '.' if path else ''}{method}", getattr(owner, method)))
    original_get_output = AsyncModelRunnerOutput.get_output
    AsyncModelRunnerOutput.get_output = wrap_get_output(original_get_output)

    def undo():
        AsyncModelRunnerOutput.get_output = original_get_output
        for owner, method, before in restore:
            if before is None:
                delattr(owner, method)
            else:
                setattr(owner, method, before)
    return undo


def time_phases(engine) -> tuple[dict[str, float], Callable[[], None]]:
    """Wraps the engine loop's phases (and the wait for each step's results) with timers; returns the running
    totals in seconds and a function that restores the originals."""
    totals: dict[str, float] = collections.defaultdict(float)

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                totals[name] += time.perf_counter() - t0
        return wrapper

    def timed_get_output(original):
        def get_output(self):
            result = original(self)
            totals["wait for the device"] += self.waited
            return result
        return get_output

    return totals, patch_engine(engine, PHASES, timed, timed_get_output)


# Where the device timeline is marked: a CUDA event recorded (and the host clock read) as the host enters (">")
# and leaves ("<") each of these; replays are told apart by their key's type (the target's or the draft's graph).
TIMELINE_MARKS = [("runner", "execute_model"), ("runner.input_batch", "prepare"),
                  ("runner.graphs.captured", "replay"), ("runner.drafting", "draft_on_device")]


def mark_timeline(engine) -> tuple[list[tuple[str, torch.cuda.Event, float]], Callable[[], None]]:
    """Wraps TIMELINE_MARKS (and the wait for each step's results) to record (label, event, host time) at each
    entry and exit; returns the list and a function that restores the originals."""
    marks: list[tuple[str, torch.cuda.Event, float]] = []

    def mark(label: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((label, event, time.perf_counter()))

    def marked(path, fn):
        name = path.rsplit(".", 1)[-1]

        def wrapper(*a, **kw):
            label = f"{name}({type(a[0]).__name__})" if name == "replay" else name
            mark(label + ">")
            try:
                return fn(*a, **kw)
            finally:
                mark(label + "<")
        return wrapper

    def marked_get_output(original):
        def get_output(self):
            mark("get_output>")
            try:
                return original(self)
            finally:
                mark("get_output<")
        return get_output

    return marks, patch_engine(engine, TIMELINE_MARKS, marked, marked_get_output)


def print_timeline(marks: list[tuple[str, torch.cuda.Event, float]], steps: int) -> None:
    """Per transition between consecutive marks: how often, and the median device and host time between them.
    Where the device keeps pace with the host over a stretch (device time ~ host time there), the device waited
    for the host's launches; where it takes longer, the host ran ahead (and waits for it later)."""
    torch.cuda.synchronize()
    spans = collections.defaultdict(list)
    for (a, ea, ta), (b, eb, tb) in itertools.pairwise(marks):
        spans[f"{a} -> {b}"].append((ea.elapsed_time(eb) * 1e3, (tb - ta) * 1e6))
    print(f"device timeline: transitions between marks (median us; total us per step over {steps} steps)")
    print(f"  {'transition':62s} {'count':>5s} {'device':>8s} {'host':>8s} {'dev/step':>9s} {'host/step':>9s}")
    for name, values in spans.items():
        dev, host = sorted(v[0] for v in values), sorted(v[1] for v in values)
        print(f"  {name:62s} {len(values):5d} {dev[len(dev) // 2]:8.1f} {host[len(host) // 2]:8.1f} "
              f"{sum(dev) / steps:9.1f} {sum(host) / steps:9.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default=None, help="the --speculative-config JSON (none: no speculation)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=1, help="requests per run, submitted together")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--async-scheduling", choices=("on", "off"), default=None,
                    help="force async scheduling on or off (default: the engine's choice)")
    args = ap.parse_args()
    spec = json.loads(args.spec) if args.spec else None
    if spec is not None and spec["method"] == "dspark":
        spec.setdefault("model", str(DEFAULT_DSPARK_DIR))
    llm = LLM(device=args.device, max_model_len=1024, gpu_memory_utilization=0.3, speculative_config=spec,
              async_scheduling=None if args.async_scheduling is None else args.async_scheduling == "on")
    prompts = [{"prompt_token_ids": ids} for ids in heldout_code_windows(llm.get_tokenizer(),
                                                                          [64] * args.concurrency)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def run():
        return llm.generate(prompts, params, use_tqdm=False)

    run()
    runner = llm.llm_engine.runner
    paths, replayed = count_step_paths(runner)
    walls = []
    for _ in range(args.repeats):
        sync(args.device)
        t0 = time.perf_counter()
        out = run()
        sync(args.device)
        walls.append(time.perf_counter() - t0)
    steps = max(o.metrics.spec_num_drafts for o in out) or args.output_len  # the run lasts as long as its longest
    wall = sorted(walls)[len(walls) // 2]
    print("step paths over the timed runs:", dict(paths))
    print(f"{wall / args.output_len * 1e3:.3f} ms per token, {wall / steps * 1e3:.3f} ms per step "
          f"({steps} steps for {args.output_len} tokens)")
    verifier = runner.adaptive_verifier
    if verifier is not None:  # what adaptive's budget chose and weighed, over all runs so far
        times = verifier.times
        print(f"adaptive: kept {verifier.num_kept} of {verifier.num_offered} drafts, {verifier.num_refreshed} steps "
              f"re-measured untrimmed; survivals calibrated x{verifier.calibration.scale.round(2).tolist()} "
              f"per position over {verifier.calibration.num_rows} rows" + ("" if times is None else
                                          f"; host {times.host * 1e3:.3f} ms per step, measured periods (ms, "
                                          f"requests x graph tokens): {times.summary_ms()}"))
    totals, undo = time_phases(llm.llm_engine)
    sync(args.device)
    t0 = time.perf_counter()
    run()
    sync(args.device)
    timed_wall = time.perf_counter() - t0
    undo()
    print(f"host phases, ms per step (one timed run: {timed_wall / steps * 1e3:.3f} ms per step with timers):")
    top = ("scheduler.schedule", "runner.execute_model", "wait for the device", "_process_step")
    totals["other (the step's wall less the phases above it)"] = timed_wall - sum(totals[n] for n in top)
    for name, total in totals.items():
        print(f"  {name:50s} {total / steps * 1e3:8.3f}")
    if args.device == "cuda":
        marks, undo = mark_timeline(llm.llm_engine)
        run()
        undo()
        print_timeline(marks, steps)
    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(args.top)
        print(s.getvalue())
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        run()
        sync(args.device)
    kernels = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"{len(kernels) / steps:.1f} device kernels per step, "
          f"{sum(e.device_time for e in kernels) / steps / 1e3:.3f} ms device time per step")
    print(p.key_averages().table(sort_by="device_time_total", row_limit=args.top))
    if runner.graphs.captured is not None and args.device == "cuda":
        print("device time per graph replay, back to back (us):")
        for key, us in time_graph_replays(runner.graphs.captured, replayed).items():
            print(f"  {key:90s} {us:8.1f}")


if __name__ == "__main__":
    main()
