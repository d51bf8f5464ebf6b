"""The built-in model's dense projections at the few-token shapes of decode and verify steps, per BLAS library.

    python benchmarks/kernels/bench_small_gemm.py --out benchmarks/results/gpu/small_gemm.json

A verify step of K drafts runs every projection over 1+K tokens per request. For each distinct [out, in] weight
of the built-in checkpoint and each token count M, times F.linear(x[M, in], w) in the checkpoint's fp32 (CUDA
graph replays, median) with torch's default BLAS (cuBLAS) and with cuBLASLt, and flags any shape whose time is
far above what its weight read costs at copy bandwidth: a heuristic that picks a bad kernel at some M.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import metadata, write_json  # noqa: E402
from timing import copy_bandwidth_gbps, time_graph  # noqa: E402

from vllm.assets import DEFAULT_MODEL_DIR  # noqa: E402


def checkpoint_shapes() -> list[tuple[int, int]]:
    shapes = set()
    for path in sorted(DEFAULT_MODEL_DIR.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                if len(shape) == 2 and min(shape) > 8:  # projections; not per-head vectors or the router
                    shapes.add(tuple(shape))
    return sorted(shapes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,2,4,8,16,32")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth_gbps()
    rows = []
    for out_f, in_f in checkpoint_shapes():
        w = torch.randn(out_f, in_f, device="cuda", dtype=dtype)
        for m in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(m, in_f, device="cuda", dtype=dtype)
            row = {"out": out_f, "in": in_f, "tokens": m}
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                row[f"{lib}_us"] = time_graph(lambda: F.linear(x, w))["median"]  # noqa: B023
            torch.backends.cuda.preferred_blas_library("cublas")
            row["weight_read_us"] = w.numel() * w.element_size() / (bandwidth * 1e9 / 2) * 1e6
            rows.append(row)
            print(f"[{out_f:5d} x {in_f:4d}] M={m:3d}: cublas {row['cublas_us']:7.2f} us, "
                  f"cublaslt {row['cublaslt_us']:7.2f} us (weight read {row['weight_read_us']:.2f} us)", flush=True)
    if args.out:
        write_json(args.out, {"meta": metadata("cuda"), "dtype": args.dtype, "copy_gbps": bandwidth, "rows": rows})


if __name__ == "__main__":
    main()
