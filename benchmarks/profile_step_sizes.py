"""Device time of the built-in model's decode or verify step at each token count, and the kernels whose time
changes between two counts: where a step slows down past some size, and which kernel does it.

    python benchmarks/profile_step_sizes.py --sizes 4,8,16,24,32,48,64 --compare 16,32
    python benchmarks/profile_step_sizes.py --spec '{"method": "dspark", "num_speculative_tokens": 3}' \
        --sizes 4,8,12,16,20,24,28,32 --compare 16,32 --out benchmarks/results/gpu/step_sizes.json

Why: on the H200 every step past 16 tokens cost 0.6-1 ms more (docs/spec_decode.md, "a cliff above 16
tokens"), with or without speculation. Each size runs the runner's own dummy step (ModelRunner.dummy_decode_step,
as the adaptive cost tables do): rows of 1+K tokens over `--context` cached tokens, replayed in the graph a real
step of that size replays. Per size: the median device time of `--repeats` back-to-back runs between CUDA events
(no host in it), and the graph it replayed. Per --compare size: each kernel's device time per step under
torch.profiler, then the kernels side by side, largest change first. `--enforce-eager` runs the same forwards
without graphs (every kernel launched by the host: the device times then include its gaps); with it,
`--by-gemm-shape` compares the matrix multiplies by op and input shapes instead, to tell which projection
launched a slow kernel. On a CPU it times the eager forwards by wall clock and compares torch ops by CPU time.
"""
from __future__ import annotations

import argparse
import collections
import json

import torch
from bench_common import device_us_per_call, metadata, sync, write_json
from torch.profiler import ProfilerActivity, profile

from vllm import LLM
from vllm.assets import DEFAULT_DSPARK_DIR

GEMM_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")


def kernel_us(run, device: str, steps: int, by_gemm_shape: bool = False) -> dict[str, float]:
    """Per kernel name (torch op name on a CPU): its device (CPU) time per run, over `steps` profiled runs.
    by_gemm_shape: instead, per matrix-multiply op and input shapes, the device time of the kernels it launched
    (eager runs only: a graph replay records no ops)."""
    run()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities, record_shapes=by_gemm_shape) as prof:
        for _ in range(steps):
            run()
        sync(device)
    per_name: dict[str, float] = collections.defaultdict(float)
    if by_gemm_shape:
        for e in prof.key_averages(group_by_input_shape=True):
            us = e.device_time_total if device == "cuda" else e.cpu_time_total
            if e.key in GEMM_OPS and us > 0:
                per_name[f"{e.key} {e.input_shapes}"] += us / steps
        return per_name
    for e in prof.key_averages():
        us = e.self_device_time_total if device == "cuda" else e.self_cpu_time_total
        if us > 0 and (device != "cuda" or e.device_type == torch.autograd.DeviceType.CUDA):
            per_name[e.key] += us / steps
    return per_name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--spec", default=None, help="the --speculative-config JSON (default: no speculation)")
    ap.add_argument("--sizes", default="4,8,16,24,32,48,64", help="token counts per step")
    ap.add_argument("--compare", default="16,32", help="two sizes whose kernels are compared")
    ap.add_argument("--context", type=int, default=192, help="cached tokens per row (the Pareto sweep's ends "
                                                            "at 64 prompt + 128 output tokens)")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--profile-steps", type=int, default=20)
    ap.add_argument("--rows", type=int, default=25, help="kernels shown in the comparison")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--by-gemm-shape", action="store_true",
                    help="compare matrix-multiply ops by input shapes instead of kernels (with --enforce-eager)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    spec = json.loads(args.spec) if args.spec else None
    if spec is not None and spec["method"] == "dspark":
        spec.setdefault("model", str(DEFAULT_DSPARK_DIR))
    llm = LLM(device=args.device, dtype=args.dtype, max_model_len=1024, max_num_seqs=args.max_num_seqs,
              gpu_memory_utilization=0.3, speculative_config=spec, enforce_eager=args.enforce_eager)
    runner = llm.llm_engine.runner
    sizes = [int(n) for n in args.sizes.split(",")]
    a, b = (int(n) for n in args.compare.split(","))
    rows, kernels = [], {}
    with torch.inference_mode():
        for n in sorted(set(sizes) | {a, b}):
            common, desc, run = runner.dummy_decode_step(n, args.context)
            us = device_us_per_call(run, args.device, args.repeats)
            rows.append({"tokens": n, "requests": common.num_reqs, "graph": str(desc), "step_us": us})
            print(f"{n:4d} tokens, {common.num_reqs:3d} requests: {us:8.1f} us per step  ({desc or 'eager'})",
                  flush=True)
            if n in (a, b):
                kernels[n] = kernel_us(run, args.device, args.profile_steps, args.by_gemm_shape)
    names = sorted(set(kernels[a]) | set(kernels[b]), key=lambda k: -abs(kernels[b].get(k, 0) - kernels[a].get(k, 0)))
    print(f"\nper step, us: {'at ' + str(a):>10s} {'at ' + str(b):>10s} {'change':>9s}  kernel")
    for name in names[:args.rows]:
        x, y = kernels[a].get(name, 0.0), kernels[b].get(name, 0.0)
        print(f"              {x:10.1f} {y:10.1f} {y - x:+9.1f}  {name[:110]}")
    print(f"              {sum(kernels[a].values()):10.1f} {sum(kernels[b].values()):10.1f} "
          f"{sum(kernels[b].values()) - sum(kernels[a].values()):+9.1f}  (all)")
    if args.out:
        write_json(args.out, {"meta": metadata(args.device), "args": vars(args), "rows": rows,
                              "kernels_us": {str(k): v for k, v in kernels.items()}})


if __name__ == "__main__":
    main()
