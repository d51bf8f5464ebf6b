"""Where a served closed-loop load's time goes in the engine core: each step's time and shape, and the core's idle
gaps, at one concurrency (issue 51: served throughput against offline at batch 64).

    python benchmarks/trace_served_steps.py --device cuda --config benchmarks/configs/kimi-linear-1b3.json \
        --dtype bfloat16 --concurrency 64 --input-len 256 --output-len 128 --serve-args "--api-server-count 4" \
        --out benchmarks/results/gpu/served_steps.json

Serves the offline benchmark's random checkpoint (same --config and --seed) as bench_serve_sweep.py does, with
benchmarks/ttft_trace/ on PYTHONPATH so that the core stamps each step (its outputs, rows, tokens, prefill rows
and tokens) and each request's arrival. Runs one warm-up round, then --waves x concurrency streamed requests
(logprobs=0, exactly --output-len tokens) and splits the load's wall time in the core into: steps that ran a
prompt chunk, decode-only steps, and idle (no step running). Per wave after the first, from the client's send
times (its clock is the core's): how long after the wave before ended the first request is sent, and how far
the sends and the core's arrivals spread. With every request's cycle the same length, the
closed loop's streams go in waves; the report gives the decode-only steps' mean rows (the batch the core ran)
and time, which with the prefill steps' total is the offline run's cost of the same work.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve
from bench_common import metadata, write_json
from bench_offline_throughput import add_checkpoint_args, build_checkpoint
from fuzz_server import start_server, stop_server
from trace_served_ttft import read_events


def core_steps(events: list[tuple[float, str, str]], t0: float, t1: float) -> tuple[list[dict], list[float]]:
    """The core's steps that began in [t0, t1] and the times requests reached it there (one process steps)."""
    core = next(pid for _, pid, n in events if n == "step_begin")
    steps, begin, arrivals = [], None, []
    for t, pid, n in events:
        if pid != core or not t0 <= t <= t1:
            continue
        if n == "step_begin":
            begin = t
        elif n.startswith("step_end") and begin is not None:
            outputs, rows, tokens, prefill_rows, prefill_tokens = map(int, n.split()[1:6])
            steps.append({"t": begin, "s": t - begin, "outputs": outputs, "rows": rows, "tokens": tokens,
                          "prefill_rows": prefill_rows, "prefill_tokens": prefill_tokens})
            begin = None
        elif n == "recv add":
            arrivals.append(t)
    return steps, arrivals


def breakdown(steps: list[dict], arrivals: list[float], wall: float) -> dict:
    ran = [s for s in steps if s["rows"] > 0]
    prefill = [s for s in ran if s["prefill_rows"] > 0]
    decode = [s for s in ran if s["prefill_rows"] == 0]
    busy = sum(s["s"] for s in steps)
    ms = 1e3
    return {
        "wall_ms": wall * ms, "steps": len(ran), "idle_ms": (wall - busy) * ms,
        "prefill_steps": len(prefill), "prefill_steps_ms": sum(s["s"] for s in prefill) * ms,
        "prefill_tokens": sum(s["prefill_tokens"] for s in prefill),
        "prefill_step_median_ms": float(np.median([s["s"] for s in prefill])) * ms if prefill else None,
        "prefill_step_rows_mean": float(np.mean([s["prefill_rows"] for s in prefill])) if prefill else None,
        "decode_steps": len(decode), "decode_steps_ms": sum(s["s"] for s in decode) * ms,
        "decode_step_median_ms": float(np.median([s["s"] for s in decode])) * ms if decode else None,
        "decode_rows_mean": float(np.mean([s["rows"] for s in decode])) if decode else None,
        "arrivals": len(arrivals),
    }


def waves(requests: list[dict], arrivals: list[float], steps: list[dict], concurrency: int) -> dict:
    """Medians over the load's waves (requests in send order, `concurrency` a wave; the first wave, sent at
    once, is left out) of: the core's last step before this wave's first send -> that send (the outputs' way
    to the client and its next send), the last finish the client saw before it -> that send, the spread of
    its sends, the spread of its arrivals at the core, and the median lag from send to arrival (sends and
    arrivals paired in order)."""
    sends = sorted(r["start"] for r in requests if r.get("start") is not None)
    ends = sorted(r["start"] + r["e2e"] for r in requests if r.get("e2e") is not None)
    arrivals = sorted(arrivals)
    rows = []
    for w in range(1, min(len(sends), len(arrivals)) // concurrency):
        s, a = sends[w * concurrency:(w + 1) * concurrency], arrivals[w * concurrency:(w + 1) * concurrency]
        before = [e for e in ends if e <= s[0]]
        core_end = max((st["t"] + st["s"] for st in steps if st["t"] + st["s"] <= s[0]), default=float("nan"))
        rows.append({"core_end_to_send": s[0] - core_end,
                     "finish_to_send": s[0] - before[-1] if before else float("nan"), "send_spread": s[-1] - s[0],
                     "arrival_spread": a[-1] - a[0], "send_to_arrival": float(np.median(np.subtract(a, s)))})
    return {f"{k}_ms": 1e3 * float(np.median([r[k] for r in rows])) for k in rows[0]} if rows else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_args(ap)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--waves", type=int, default=4, help="requests = waves x concurrency")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--serve-args", default="", help="extra `vllm serve` flags, one shell-quoted string")
    ap.add_argument("--out", default="benchmarks/results/cpu/served_steps.json")
    args = ap.parse_args()
    meta = metadata(args.device)
    work = Path(tempfile.mkdtemp(prefix="served_steps_"))
    hf, cfg = build_checkpoint(args, work / "model")
    del hf  # the server needs the device's memory
    if args.device == "cuda":
        import torch
        torch.cuda.empty_cache()
    trace = work / "events"
    trace.mkdir()
    os.environ["TTFT_TRACE"] = str(trace)
    hook = str(Path(__file__).resolve().parent / "ttft_trace")
    os.environ["PYTHONPATH"] = os.pathsep.join([hook] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    c, P, O = args.concurrency, args.input_len, args.output_len  # noqa: E741 - prompt and output lengths
    flags = [str(work / "model"), "--dtype", args.dtype, "--device", args.device, "--seed", str(args.seed),
             "--max-model-len", str(P + O + 8), "--max-num-seqs", str(c), *shlex.split(args.serve_args)]
    proc, url = start_server(flags, api_key=None)
    common = ["--base-url", url, "--max-concurrency", str(c), "--input-len", str(P), "--output-len", str(O),
              "--vocab-size", str(cfg["vocab_size"]), "--seed", str(args.seed), "--every-token"]
    try:
        bench_serve.main(common + ["--num-prompts", str(c), "--out", str(work / "warmup.json")])
        t0 = time.monotonic()
        res = bench_serve.main(common + ["--num-prompts", str(args.waves * c), "--out", str(work / "load.json")])
        t1 = time.monotonic()
    finally:
        stop_server(proc)
    events = read_events(trace)
    shutil.rmtree(work, ignore_errors=True)
    steps, arrivals = core_steps(events, t0, t1)
    # From the first request's arrival to the last step: the client's start-up is not the core's time.
    start = min(arrivals) if arrivals else t0
    end = max((s["t"] + s["s"] for s in steps), default=t1)
    summary = breakdown([s for s in steps if s["t"] >= start], arrivals, end - start)
    summary.update(waves(res["requests"], arrivals, steps, c))
    s = res["summary"]
    print(f"{s['output_token_throughput']:.1f} output tok/s, TTFT median {s['ttft_ms']['median']:.1f} ms, "
          f"TPOT median {s['tpot_ms']['median']:.2f} ms")
    for k, v in summary.items():
        print(f"  {k:24} {v:10.2f}" if isinstance(v, float) else f"  {k:24} {v}")
    path = write_json(args.out, {**meta, "benchmark": "trace_served_steps", "config": vars(args),
                                 "serve_flags": flags[1:], "summary": s, "core": summary,
                                 "steps": [{**st, "t": st["t"] - start} for st in steps if st["t"] >= start],
                                 "arrivals": [t - start for t in arrivals]})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
