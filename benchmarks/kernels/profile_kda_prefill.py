"""Where the `triton` KDA prefill spends its time: torch.profiler's per-kernel CUDA time for one prompt.

Compares our whole prefill (conv, state gather, chunk_kda, state scatter, gated RMSNorm) with fla-core's
`chunk_kda` alone on the same inputs, so the wrapper's cost shows kernel by kernel; then times the conv's
tile configurations against the bytes it must move.

    python benchmarks/kernels/profile_kda_prefill.py --heads 32 --tokens 16384
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_kda_decode import make_layer  # noqa: E402
from bench_kda_prefill import fla_chunk_only, make_prompt  # noqa: E402
from timing import REFERENCE_COPY_GBPS, time_graph  # noqa: E402

from vllm.attention.kda.conv import causal_conv1d_silu  # noqa: E402

from vllm.attention.selector import load_backend  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--conv-only", action="store_true", help="only the conv tile sweep")
    args = ap.parse_args()
    torch.manual_seed(0)
    layer = make_layer(args.heads)
    rows, inputs, conv, ssm = make_prompt(args.heads, args.tokens)
    backend = load_backend("--kda-prefill-backend", "triton")
    runs = {"triton backend": lambda: backend.forward_prefill(layer, *inputs, conv, ssm, rows),
            "fla chunk_kda alone": fla_chunk_only(layer, rows, inputs)}
    for name, fn in ({} if args.conv_only else runs).items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.reps):
                fn()
            torch.cuda.synchronize()
        print(f"=== {name}: H={args.heads} T={args.tokens}, {args.reps} calls ===")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    x = inputs[0]
    moved = 2 * x.numel() * x.element_size()  # read x, write y
    for bt, bc, nw in [(64, 128, 4), (32, 128, 4), (16, 256, 4), (32, 256, 8), (64, 64, 4), (8, 512, 4), (128, 64, 4)]:
        t = time_graph(lambda: causal_conv1d_silu(x, layer.conv_weight, conv, rows.query_start_loc, rows.state_indices,
                                                  rows.has_initial_state, rows.max_query_len, num_splits=3,
                                                  block_t=bt, block_c=bc, num_warps=nw), reps=20, calls_per_rep=5)
        us = t["median"]
        print(f"conv block_t={bt:3} block_c={bc:3} warps={nw}: {us:8.1f} us, "
              f"{moved / us / 1e3 / REFERENCE_COPY_GBPS:.0%} of copy bandwidth")


if __name__ == "__main__":
    main()
