"""Host time of adaptive verification's per-step work: the budget hook (AdaptiveVerifier), and the drafter's
confidence copy (DraftConfidences.update), at K = 3 and 1..64 requests.

    python benchmarks/bench_adaptive_hook.py --out benchmarks/results/cpu/adaptive_hook_cpu.json
    python benchmarks/bench_adaptive_hook.py --device cuda --out benchmarks/results/gpu/adaptive_hook.json

Each call runs on the host before the step's graph is launched, so at one request (a ~1.6 ms step on the H200)
every 16 us is 1% of the step. Cases:
- "keeps-all": no host time recorded, a device table whose every token costs more, the untrimmed step's periods
  measured at the tables' cost, and confident drafts (0.98-1.0): the budget reads the confidences, sorts every
  survival, weighs the measured shape and keeps every draft, leaving its prediction for the calibration. The
  H200 sweeps ran in this regime (99.7-100% of drafts kept at 1-64 requests), so it is adaptive's overhead
  over fixed K there;
- "trims": the same with confidences uniform in [0, 0.1], which the budget trims (and the device re-cuts);
- "host-bound": a host time above the device's cost of the whole step (the hook keeps every draft without
  reading the confidences).
Also the engine's side of a kept step: taking the prediction and handing back its outcome (observe, with the
calibration's batched fold amortised over the calls). Median of `--repeats` timings of `--iters` calls each,
after a warm-up.
"""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch
from bench_common import metadata, per_call_us, stats, write_json

from vllm.spec_decode.adaptive_verification import AdaptiveVerifier, CostCurve, DraftConfidences, StepTimes, VerifyCosts
from vllm.spec_decode.adaptive_verification.step_times import MIN_PERIOD_SAMPLES


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
    verify = CostCurve.from_samples({n: [1e-3 + 1e-4 * n] for n in (4, 8, 16, 32, 64, 128, 256, 512)}, 512)
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
        confident = 0.98 + 0.02 * torch.rand(R, K, device=device, generator=gen)
        for case, host, confidences in (("keeps-all", 0.0, confident), ("trims", 0.0, 0.1 * table),
                                        ("host-bound", 1.0, table)):
            conf.update(ids, confidences)
            conf.update(ids, confidences)  # the host copy of these has landed by the calls below
            if device.type == "cuda":
                torch.cuda.synchronize()
            times = StepTimes(True, verify.padded, host=host)
            costs = VerifyCosts(draft, verify)
            for _ in range(MIN_PERIOD_SAMPLES):  # the untrimmed step, recently measured: trimming may be chosen
                period = float(costs.step_costs(R, R, R * K)[-1])
                times.record(period, period - host, (R, R + R * K, False))
            verifier = AdaptiveVerifier(conf, costs, 8192, times)
            row[f"hook_{case}_us"] = host_us(lambda: verifier(step, None), args.iters, args.repeats)  # noqa: B023
            row[f"hook_{case}_kept"] = f"{verifier.last_budget} of {R * K} drafts"
            if case == "keeps-all":
                accepted = [K] * R  # (all accepted: the ratios stay at or above 1, the budget keeps all)

                def engine_side() -> None:
                    verifier(step, None)  # noqa: B023
                    verifier.observe(verifier.take_prediction(), accepted)  # noqa: B023
                # The hook again inside, for a prediction to hand back: its own median is taken off.
                both = stats(per_call_us(engine_side, args.iters, args.repeats, warmup=args.iters // 10))
                row["observe_us"] = both["median"] - row["hook_keeps-all_us"]["median"]
        rows.append(row)
        print(f"{R:3d} requests: hook {row['hook_keeps-all_us']['median']:6.1f} us (keeps all "
              f"{row['hook_keeps-all_kept']}), {row['hook_trims_us']['median']:6.1f} us (trims, kept "
              f"{row['hook_trims_kept']}), {row['hook_host-bound_us']['median']:5.1f} us (host-bound); "
              f"observe {row['observe_us']:5.1f} us; confidence copy {row['update_us']['median']:5.1f} us",
              flush=True)
    if args.out:
        write_json(args.out, {"meta": metadata(args.device), "rows": rows})


if __name__ == "__main__":
    main()
