"""Where `vllm serve`'s front-end process spends its CPU under a streamed load: py-spy samples of the API server
process (not the engine core), by function, plus its CPU seconds per request and per streamed token.

    python benchmarks/profile_frontend.py --device cuda --config benchmarks/configs/kimi-linear-1b3.json \
        --dtype bfloat16 --concurrency 64 --num-prompts 256 --input-len 256 --output-len 128

Serves the offline benchmark's random checkpoint (`--config tiny` on a CPU: the tiny tokenizer), warms up at the
concurrency, then samples the front end with `py-spy record --format raw` (pip install py-spy; on the device
machine, carry its wheel) while bench_serve.py runs `--every-token` (logprobs=0: a chunk per token). Prints the
functions by own and by inclusive share of the non-idle samples: the front end's ceiling at high concurrency is
its CPU per streamed token (docs/serving.md).
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

# A sample whose leaf is the event loop's wait is an idle front end, not work.
IDLE_LEAVES = ("EpollSelector.select", "KqueueSelector.select", "SimpleQueue.get", "Condition.wait")


def _function(frame: str) -> str:
    """`name (file:line)` -> `name (file)`: a function's samples add up over its lines."""
    return re.sub(r":\d+\)$", ")", frame)


def summarize(raw_lines: list[str], top: int = 25) -> dict:
    """py-spy's raw (collapsed) stacks, `frame;frame;... count` per line -> the busy share of samples, and the
    functions by own and inclusive share of the busy samples."""
    own, inclusive = collections.Counter(), collections.Counter()
    total = busy = 0
    for line in raw_lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [_function(f) for f in stack.split(";")]
        if frames[-1].startswith(IDLE_LEAVES):
            continue
        busy += n
        own[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n

    def shares(counter):
        return [(f, round(100 * n / busy, 1)) for f, n in counter.most_common(top)] if busy else []
    return {"samples": total, "busy_share": round(busy / total, 3) if total else 0.0, "own": shares(own),
            "inclusive": shares(inclusive)}


def main() -> None:
    # Siblings in benchmarks/ (on sys.path when run as a script), and heavy: summarize() is tested without them.
    import bench_serve
    from bench_offline_throughput import build_checkpoint
    from bench_serve_sweep import child_pids, cpu_seconds
    from fuzz_server import start_server

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--no-py-spy", action="store_true", help="CPU seconds only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="profile_frontend_"))
    hf, cfg = build_checkpoint(argparse.Namespace(config=args.config, device=args.device, dtype=args.dtype, seed=0),
                               tmp)
    del hf
    flags = [str(tmp), "--device", args.device, "--dtype", args.dtype, "--max-num-seqs", str(args.concurrency),
             "--max-model-len", str(args.input_len + args.output_len + 8)]
    proc, url = start_server(flags, api_key=None)
    load = ["--base-url", url, "--max-concurrency", str(args.concurrency), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--vocab-size", str(cfg["vocab_size"]), "--seed", "0",
            "--every-token"]
    raw = tmp / "py_spy_raw.txt"
    try:
        bench_serve.main(load + ["--num-prompts", str(args.concurrency), "--out", str(tmp / "warmup.json")])
        spy = None if args.no_py_spy else subprocess.Popen(
            ["py-spy", "record", "--pid", str(proc.pid), "--rate", str(args.rate), "--format", "raw", "--nonblocking",
             "-o", str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0 if spy else 0.0)  # py-spy attaches
        core = child_pids(proc.pid)
        front0, core0 = cpu_seconds(proc.pid), sum(cpu_seconds(p) for p in core)
        res = bench_serve.main(load + ["--num-prompts", str(args.num_prompts), "--out", str(tmp / "load.json")])
        front = cpu_seconds(proc.pid) - front0
        core_s = sum(cpu_seconds(p) for p in core) - core0
        if spy:
            spy.send_signal(signal.SIGINT)
            spy.wait(60)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    s = res["summary"]
    tokens = args.num_prompts * args.output_len
    result = {"args": vars(args), "output_tok_s": s["output_token_throughput"], "duration_s": s.get("duration_s"),
              "front_end_cpu_s": round(front, 3), "engine_core_cpu_s": round(core_s, 3),
              "front_end_cpu_ms_per_request": round(1e3 * front / args.num_prompts, 3),
              "front_end_cpu_us_per_token": round(1e6 * front / tokens, 1)}
    if raw.is_file():
        result["profile"] = summarize(raw.read_text().splitlines())
    print(json.dumps({k: v for k, v in result.items() if k != "profile"}, indent=1))
    for kind in ("own", "inclusive"):
        print(f"== by {kind} share of the busy samples")
        for f, pct in result.get("profile", {}).get(kind, []):
            print(f"{pct:5.1f}%  {f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
