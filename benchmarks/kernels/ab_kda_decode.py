"""A/B of the native KDA decode kernel against an earlier version of it, in the same run (same GPU, clocks, inputs).

The earlier version is a copy of its vllm/attention/kda/native.py, loaded as a module of its own:

    git show d5e1381:vllm/attention/kda/native.py > /tmp/native_old.py
    python benchmarks/kernels/ab_kda_decode.py --old /tmp/native_old.py --label d5e1381 \
        --out benchmarks/results/gpu/kda_decode_ab.json
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import metadata, write_json  # noqa: E402
from bench_kda_decode import K, make_layer, make_step  # noqa: E402
from timing import REFERENCE_COPY_GBPS, time_graph  # noqa: E402

from vllm.attention.kda import native  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, help="path of the earlier native.py")
    ap.add_argument("--label", default="old")
    ap.add_argument("--heads", default="12,32,96")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--out", default="benchmarks/results/gpu/kda_decode_ab.json")
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("native_old", args.old)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    torch.manual_seed(0)
    results = []
    for state_dtype, H in itertools.product((torch.float32, torch.bfloat16), map(int, args.heads.split(","))):
        layer = make_layer(H)
        for B in map(int, args.batches.split(",")):
            rows, inputs, conv, ssm = make_step(H, B, state_dtype)
            state_bytes = 2 * B * H * K * K * ssm.element_size()
            for label, module in ((args.label, old), ("this tree", native)):
                fn = functools.partial(module.fused_kda_decode, *inputs, layer.conv_weight, layer.A_log,
                                       layer.dt_bias, layer.o_norm.weight, layer.o_norm.eps, layer.gate_lower_bound,
                                       conv, ssm, rows.query_start_loc, rows.state_indices, num_heads=H, head_dim=K,
                                       max_query_len=1)
                t = time_graph(fn)
                pct = 100 * state_bytes / (t["median"] * 1e-6) / 1e9 / REFERENCE_COPY_GBPS
                results.append({"kernel": label, "state_dtype": str(state_dtype)[6:], "heads": H, "batch": B,
                                "us": t, "pct_reference_copy_bw": pct})
                print(f"{str(state_dtype)[6:]:8} H={H:3} B={B:3} {label:10} {t['median']:8.1f} us {pct:5.1f}%",
                      flush=True)
    write_json(args.out, {"meta": metadata("cuda"), "results": results})


if __name__ == "__main__":
    main()
