"""Where fla-core's `chunk_kda` spends its host time: cProfile over 50 eager calls of one prefill shape.

The kernels of a short prefill take a fraction of a millisecond while a call costs milliseconds of host time
(docs/performance.md, 2026-12-07f); this shows which Python layers (Triton's launcher and autotuner, fla's
config cache and wrappers) that time is in.

    python benchmarks/kernels/profile_chunk_kda_host.py --heads 16 --prompts 4 --tokens 256
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kda_decode import make_layer  # noqa: E402
from bench_kda_prefill import fla_chunk_only, make_prompt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per prompt")
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    torch.manual_seed(0)
    layer = make_layer(args.heads)
    rows, inputs, _, _ = make_prompt(args.heads, args.tokens, N=args.prompts)
    fn = fla_chunk_only(layer, rows, inputs)
    for _ in range(5):
        fn()  # compiles and autotunes
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.calls):
        fn()
    queued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    print(f"host per call {(queued - t0) / args.calls * 1e3:.3f} ms (queueing only), "
          f"{(done - t0) / args.calls * 1e3:.3f} ms to the GPU's end")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(35)
    stats.sort_stats("cumulative").print_stats(45)


if __name__ == "__main__":
    main()
