"""GPU timing for kernel benchmarks: CUDA-graph replays timed with events, medians of many; copy bandwidth."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench_common

from bench_common import metadata, stats  # noqa: E402


def time_graph(fn: Callable[[], object], reps: int = 30, calls_per_rep: int = 20, graph: bool = True) -> dict:
    """Per-call microseconds of fn: `reps` timings of `calls_per_rep` back-to-back calls (in one CUDA graph)."""
    for _ in range(3):
        fn()  # warm-up: Triton autotuning and compilation happen here, outside the graph
    torch.cuda.synchronize()
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            with torch.cuda.graph(g, stream=stream):
                for _ in range(calls_per_rep):
                    fn()
        torch.cuda.current_stream().wait_stream(stream)
        run = g.replay
    return stats(_event_reps(run if graph else _repeated(run, calls_per_rep), reps, calls_per_rep))


def _repeated(fn: Callable[[], object], n: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(n):
            fn()
    return run


def _event_reps(rep: Callable[[], object], reps: int, calls_per_rep: int,
                before: Callable[[], object] | None = None) -> list[float]:
    """Per-call microseconds of `reps` runs of `rep` (which makes `calls_per_rep` calls), timed with CUDA events;
    `before` is queued ahead of each run, outside the events."""
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        rep()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls_per_rep)
    return times


def time_gpu_only(fn: Callable[[], object], reps: int = 20, calls_per_rep: int = 5) -> dict:
    """Per-call microseconds of fn's GPU work alone, eager: each rep's calls are queued behind a sleep kernel long
    enough to hide their host time (launches, Python), so the events time the kernels back to back. A call that
    waits for the GPU (a blocking copy) cannot be hidden: its wait shows up here as GPU time."""
    rep = _repeated(fn, calls_per_rep)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    rep()
    torch.cuda.synchronize()
    # Cycles to sleep: twice the host time of a rep, at a conservative 1 GHz.
    cycles = int(2 * (time.perf_counter() - t0) * 1e9) + 1_000_000
    return stats(_event_reps(rep, reps, calls_per_rep, before=lambda: torch.cuda._sleep(cycles)))


# Copy bandwidth of this H200 measured by the shared peer run (../shared/bench/README.md, 2026-11-29).
REFERENCE_COPY_GBPS = 4271.0


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy bandwidth, read + write bytes counted: the best of a few buffer sizes."""
    best = 0.0
    for nbytes in (1 << 28, 1 << 29, 1 << 30):
        src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
        dst = torch.empty_like(src)
        for _ in range(50):  # let the clocks ramp up before timing
            dst.copy_(src)
        us = time_graph(lambda: dst.copy_(src), reps=30, calls_per_rep=10)["median"]  # noqa: B023
        best = max(best, 2 * nbytes / (us * 1e-6) / 1e9)
    return best


def bandwidth_report() -> tuple[dict, float]:
    """A bandwidth benchmark's JSON skeleton (meta, the copy bandwidths, empty `skipped` and `results`, filled
    and rewritten row by row) and the copy bandwidth in GB/s that percentages are taken against.

    That is the better of this run's measurement and the shared reference: a copy measured low (a cold clock,
    a busy GPU) would put kernels above 100% of a physical limit. `copy_bw_basis` says which one it is.
    """
    measured = copy_bandwidth_gbps()
    # The shared reference was measured on an H200: another card (an H100's copy runs ~3.3 TB/s) is held to
    # its own measurement only.
    reference = REFERENCE_COPY_GBPS if "H200" in torch.cuda.get_device_name() else 0.0
    bw = max(measured, reference)
    basis = "measured in this run" if measured >= reference else "shared reference (../shared/bench)"
    print(f"copy bandwidth {measured:.0f} GB/s measured, {reference:.0f} reference: "
          f"percentages of {bw:.0f} ({basis})")
    return {"meta": metadata("cuda"), "copy_bw_gbps": measured, "reference_copy_bw_gbps": reference,
            "pct_basis_gbps": bw, "copy_bw_basis": basis, "skipped": {}, "results": []}, bw


def matmul_peak_tflops() -> float:
    """bf16 matmul peak as cuBLAS reaches it on this card (8192^3), the roofline's compute side."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    us = time_graph(lambda: a @ b, reps=20, calls_per_rep=5)["median"]
    return 2 * 8192 ** 3 / (us * 1e-6) / 1e12


def roofline_us(nbytes: float, flops: float, copy_gbps: float, peak_tflops: float) -> float:
    """The larger of the bytes at copy bandwidth and the FLOPs at the matmul peak, in microseconds."""
    return max(nbytes / (copy_gbps * 1e9), flops / (peak_tflops * 1e12)) * 1e6

