"""What every benchmark records (DESIGN.md section 8): command line, git commit, device, versions, time."""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    if os.environ.get("VLLM_GIT_COMMIT"):  # the GPU machine gets a copy of the tree without .git
        return os.environ["VLLM_GIT_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=False).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    try:  # platform.processor() is empty on many Linux machines
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def metadata(device: str) -> dict:
    return {"argv": [Path(sys.executable).name, *sys.argv], "git_commit": git_commit(),
            "device": device, "device_name": device_name(device), "torch": torch.__version__,
            "num_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "loadavg_1_5_15": os.getloadavg(),
            "python": platform.python_version(),
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def stats(xs: list[float]) -> dict:
    a = np.asarray(xs, dtype=float)
    return {"median": float(np.median(a)), "p10": float(np.percentile(a, 10)), "p90": float(np.percentile(a, 90)),
            "mean": float(a.mean()), "n": int(a.size)}


def per_call_us(fn, iters: int, repeats: int, warmup: int = 0) -> list[float]:
    """Host microseconds per call of fn, one figure per round of `iters` back-to-back calls, after `warmup`
    calls. Host time only: for device work, time between CUDA events (kernels/timing.py)."""
    for _ in range(warmup):
        fn()
    rounds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        rounds.append((time.perf_counter() - t0) / iters * 1e6)
    return rounds


def device_us_per_call(fn, device: str, repeats: int, rounds: int = 5) -> float:
    """Microseconds per call of fn, median over `rounds` rounds of `repeats` back-to-back calls after one warm
    call. On CUDA between two events, so the figure is the device's time with no host in it (where fn launches
    more slowly than the device runs it, the gaps count); elsewhere the host clock."""
    fn()
    sync(device)
    times = []
    for _ in range(rounds):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / repeats)
        else:
            t0 = time.perf_counter()
            for _ in range(repeats):
                fn()
            times.append((time.perf_counter() - t0) * 1e6 / repeats)
    return float(np.median(times))


def write_json(path: str | Path, data: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def set_threads(n: int) -> None:
    """n > 0 fixes torch's intra-op threads. On a small shared CPU (2 cores, load average ~3.7 from other
    processes) two OpenMP threads made a tiny-model decode step 1.2 s instead of 8 ms with one thread."""
    if n > 0:
        torch.set_num_threads(n)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
