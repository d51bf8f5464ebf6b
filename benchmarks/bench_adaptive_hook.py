"""Host time of adaptive verification's per-step work: the budget hook (AdaptiveVerifier), and the drafter's
confidence copy (DraftConfidences.update), at K = 3 and 1..64 requests.

    python benchmarks/bench_adaptive_hook.py --out benchmarks/results/cpu/adaptive_hook_cpu.json
    python benchmarks/bench_adaptive_hook.py --device cuda --out benchmarks/results/gpu/adaptive_hook.json

Each call runs on the host before the step's graph is launched, so at one request (a ~1.6 ms step on the H200)
every 16 us is 1% of the step. Cases:
- "device-bound": no host time recorded, a device table whose every token costs more, and the untrimmed step's
  periods measured at the tables' cost (the budget reads the confidences, sorts every survival, weighs the
  measured shape and picks b*);
- "host-bound": a host time above the device's cost of the whole step (the hook keeps every draft without
  reading the confidences).
Median of `--repeats` timings of `--iters` calls each, after a warm-up.
"""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch
from bench_common import metadata, per_call_us, stats, write_json

from vllm.spec_decode.adaptive import (MIN_PERIOD_SAMPLES, AdaptiveVerifier, CostCurve, DraftConfidences, StepTimes,
                                       VerifyCosts)


def host_us(fn, iters: int, repeats: int) -> dict:
    return stats(per_call_us(fn, iters, repeats, warmup=iters // 10))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--requests", default="1,8,64")
    ap.add_argument("--num-spec", type=int, default=3)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    K, device = args.num_spec, torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    # Verify cost rising with every token, flat draft: the budget keeps every draft of confident rows.
    verify = CostCurve.from_samples({n: [1e-3 + 1e-5 * n] for n in (4, 8, 16, 32, 64, 128, 256, 512)}, 512)
    draft = CostCurve.from_samples({n: [3e-4] for n in (1, 2, 4, 8, 16, 32, 64, 128)}, 128)
    rows = []
    for R in (int(r) for r in args.requests.split(",")):
        ids = [f"r{i}" for i in range(R)]
        step = SimpleNamespace(scheduled=[SimpleNamespace(request=SimpleNamespace(request_id=rid),
                                                          draft_token_ids=[7] * K) for rid in ids])
        conf = DraftConfidences(K, device)
        table = torch.rand(R, K, device=device, generator=gen)
        conf.update(ids, table)
        if device.type == "cuda":
            torch.cuda.synchronize()
        row = {"requests": R, "num_spec": K,
               "update_us": host_us(lambda: conf.update(ids, table), args.iters, args.repeats)}  # noqa: B023
        costs = VerifyCosts(draft, verify)
        for case, host in (("device-bound", 0.0), ("host-bound", 1.0)):
            times = StepTimes(True, verify.padded, host=host)
            for _ in range(MIN_PERIOD_SAMPLES):  # the untrimmed step, recently measured: trimming may be chosen
                period = float(costs.step_costs(R, R, R * K)[-1])
                times.record(period, period - host, (R, R + R * K))
            verifier = AdaptiveVerifier(conf, costs, 8192, times)
            row[f"hook_{case}_us"] = host_us(lambda: verifier(step, None), args.iters, args.repeats)  # noqa: B023
            row[f"hook_{case}_kept"] = f"{verifier.last_budget} of {R * K} drafts"
        rows.append(row)
        print(f"{R:3d} requests: hook {row['hook_device-bound_us']['median']:6.1f} us (device-bound, kept "
              f"{row['hook_device-bound_kept']}), {row['hook_host-bound_us']['median']:5.1f} us (host-bound); "
              f"confidence copy {row['update_us']['median']:5.1f} us", flush=True)
    if args.out:
        write_json(args.out, {"meta": metadata(args.device), "rows": rows})


if __name__ == "__main__":
    main()
