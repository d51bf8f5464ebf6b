"""Where the host's time goes in steps that run eagerly, by Python function (cProfile).

    python benchmarks/profile_host_python.py --config benchmarks/configs/kimi-linear-1b3.json --prompt-len 256

A prefill step (one request, max_tokens=1: the time to first token) runs eagerly even with decode graphs, and
so does every mixed step of a server; `--enforce-eager` decode steps too. torch.profiler shows which kernels
and aten ops ran; this shows which of our Python functions the host spent its time in, which is what an
eager step is made of when its GPU work is a tenth of it. Prints the wall time of each (median of `--repeats`,
without the profiler), then the functions by own time and by cumulative time over the profiled repeats.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path

import torch
from bench_common import sync
from bench_offline_throughput import build_checkpoint

from vllm import LLM, SamplingParams


def timed(fn, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def report(title: str, fn, args) -> None:
    fn()  # compile, autotune, warm the caches
    wall = sorted(timed(fn, args.device) for _ in range(args.repeats))[args.repeats // 2]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.repeats):
        fn()
    sync(args.device)
    prof.disable()
    print(f"=== {title}: {wall * 1e3:.2f} ms (median of {args.repeats}, without the profiler)")
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.rows)
        print(f"--- by {key}, over {args.repeats} runs\n" + out.getvalue().split("\n\n", 2)[-1].rstrip(), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="benchmarks/configs/kimi-linear-1b3.json")
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=10, help="eager decode steps per profiled repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, default=35)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    args = ap.parse_args()
    path = Path(tempfile.mkdtemp(prefix="profile_host_python_"))
    build_checkpoint(argparse.Namespace(config=args.config, device=args.device, dtype=args.dtype, seed=0), path)
    decode_tokens = 8 + args.decode_steps * (2 * args.repeats + 1)  # warm-up, timed and profiled steps
    common = dict(model=str(path), dtype=args.dtype, device=args.device, seed=0,
                  max_model_len=max(args.prompt_len, 16) + decode_tokens + 8,
                  gpu_memory_utilization=args.gpu_memory_utilization,
                  kv_cache_memory_bytes=(256 << 20) if args.device == "cpu" else None)
    gen = torch.Generator().manual_seed(0)

    llm = LLM(**common)  # the defaults: decode graphs where the device has them; the prefill is eager
    ids = torch.randint(3, llm.llm_engine.vocab_size, (args.prompt_len,), generator=gen).tolist()
    first = SamplingParams(max_tokens=1, temperature=0.0)
    report(f"time to first token, {args.prompt_len} prompt tokens",
           lambda: llm.generate([{"prompt_token_ids": ids}], first, use_tqdm=False), args)

    eager = LLM(**common, enforce_eager=True)
    engine = eager.llm_engine
    steps = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request("decode", {"prompt_token_ids": ids[:16]}, steps)
    for _ in range(4):  # the prefill, then decode steps
        engine.step()

    def decode() -> None:
        for _ in range(args.decode_steps):
            engine.step()
    report(f"{args.decode_steps} eager decode steps, batch 1", decode, args)


if __name__ == "__main__":
    main()
