"""Where a prompt's time to first token goes: torch.profiler tables over one request's whole prefill.

    python benchmarks/profile_prefill.py --config benchmarks/configs/kimi-linear-1b3.json --prompt-lens 256,32768

One engine with the default settings (graphs, backends, token budget) on a random checkpoint. For each prompt
length a first request warms the kernels up, then one request with max_tokens=1 runs under the profiler:
prints the GPU kernels by time, the host ops by time, the host waits over the whole prefill, and wall time
against the summed GPU kernel time (their gap is host time the GPU waited for).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from bench_common import sync
from torch.autograd import DeviceType
from bench_offline_throughput import build_checkpoint
from profile_decode_step import HOST_WAITS
from torch.profiler import ProfilerActivity, profile

from vllm import LLM, SamplingParams


def prefill_once(llm: LLM, ids: list[int]) -> float:
    sync("cuda")
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    sync("cuda")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="benchmarks/configs/kimi-linear-1b3.json")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--prompt-lens", default="256,8192,32768")
    ap.add_argument("--rows", type=int, default=15, help="rows per profiler table")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    args = ap.parse_args()
    path = Path(tempfile.mkdtemp(prefix="profile_prefill_"))
    build_checkpoint(argparse.Namespace(config=args.config, device="cuda", dtype=args.dtype, seed=0), path)
    lens = [int(n) for n in args.prompt_lens.split(",")]
    llm = LLM(model=str(path), dtype=args.dtype, seed=0, max_model_len=max(lens) + 16,
              gpu_memory_utilization=args.gpu_memory_utilization)
    gen = torch.Generator().manual_seed(0)
    vocab = llm.llm_engine.vocab_size
    for n in lens:
        prefill_once(llm, torch.randint(3, vocab, (n,), generator=gen).tolist())  # compile and autotune
        ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
        wall = sorted(prefill_once(llm, ids) for _ in range(3))[1]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            prefill_once(llm, ids)
        averages = prof.key_averages()
        # Kernel events only: an aten op that launched a kernel can report the same time as its own.
        gpu_us = sum(e.self_device_time_total for e in averages if e.device_type == DeviceType.CUDA)
        print(f"=== {n} prompt tokens: time to first token {wall * 1e3:.1f} ms (median of 3), GPU kernels "
              f"{gpu_us / 1e3:.1f} ms under the profiler")
        print(averages.table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
        print(averages.table(sort_by="cpu_time_total", row_limit=args.rows, max_name_column_width=70))
        calls = {e.key: e.count for e in averages}
        print("whole prefill: " + ", ".join(f"{name} {calls.get(name, 0)}" for name in HOST_WAITS), flush=True)


if __name__ == "__main__":
    main()
