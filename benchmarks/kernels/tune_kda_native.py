"""Sweeps the native KDA decode kernel's schedule knobs (programs per head, rows per block, prefetch, warps)
at batch 1 and 64.

    python benchmarks/kernels/tune_kda_native.py --out benchmarks/results/gpu/kda_native_tuning.json
"""
from __future__ import annotations

import argparse
import itertools
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import write_json  # noqa: E402
from bench_kda_decode import K, make_layer, make_step  # noqa: E402
from timing import bandwidth_report, time_graph  # noqa: E402

from vllm.attention.kda.native import BLOCK_V, fused_kda_decode  # noqa: E402

# (programs per head, state rows per block, prefetch, warps); None: the defaults. The 64- and 128-row blocks
# move as many bytes per block in bf16 as 32 and 64 rows in fp32.
CONFIGS = [None, (1, 32, False, 8), (1, 32, True, 8), (1, 32, True, 4), (2, 32, True, 8), (4, 32, True, 8),
           (4, 32, True, 4), (4, 16, True, 4), (8, 16, True, 4), (1, 16, False, 4), (1, 64, False, 8),
           (1, 64, False, 16), (1, 64, True, 16), (1, 128, False, 16), (2, 64, False, 8)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", default="32,96")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--state-dtypes", default="float32,bfloat16")
    ap.add_argument("--out", default="benchmarks/results/gpu/kda_native_tuning.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    report, bw = bandwidth_report()
    results = report["results"]
    for state_dtype in (getattr(torch, d) for d in args.state_dtypes.split(",")):
        for H, B in itertools.product(map(int, args.heads.split(",")), map(int, args.batches.split(","))):
            layer = make_layer(H)
            rows, inputs, conv, ssm = make_step(H, B, state_dtype)
            state_bytes = 2 * B * H * K * K * ssm.element_size()
            for config in CONFIGS:
                split, block_v, prefetch, warps = config or (None, BLOCK_V, None, None)
                fn = functools.partial(
                    fused_kda_decode, *inputs, layer.conv_weight, layer.A_log, layer.dt_bias, layer.o_norm.weight,
                    layer.o_norm.eps, layer.gate_lower_bound, conv, ssm, rows.query_start_loc, rows.state_indices,
                    num_heads=H, head_dim=K, max_query_len=1, split=split, block_v=block_v, prefetch=prefetch,
                    num_warps=warps)
                t = time_graph(fn)
                pct = 100 * state_bytes / (t["median"] * 1e-6) / 1e9 / bw
                results.append({"heads": H, "batch": B, "state_dtype": str(state_dtype)[6:],
                                "split": split, "block_v": block_v, "prefetch": prefetch, "num_warps": warps, "us": t,
                                "pct_copy_bw": pct})
                print(f"{str(state_dtype)[6:]:8} H={H:3} B={B:3} split={split} BV={block_v:3} prefetch={prefetch} "
                      f"warps={warps} "
                      f"{t['median']:8.1f} us {pct:5.1f}% of {bw:.0f} GB/s", flush=True)
    write_json(args.out, report)


if __name__ == "__main__":
    main()
