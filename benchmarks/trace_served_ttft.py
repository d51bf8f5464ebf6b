"""Where a served request's time to first token goes: the hops of one streamed completion through `vllm serve`.

    python benchmarks/trace_served_ttft.py --device cuda --config benchmarks/configs/kimi-linear-1b3.json \
        --dtype bfloat16 --input-len 256 --requests 30 --out benchmarks/results/gpu/ttft_trace.json

Starts `vllm serve` on the offline benchmark's random checkpoint (same --config and --seed) with
benchmarks/ttft_trace/ on PYTHONPATH: its sitecustomize.py stamps each hop in the front end and the engine core
(one monotonic clock for every process). Then sends --requests streamed completions one at a time (prompt of
token ids, logprobs=0 so the first token comes in a chunk) and reports each hop's median in ms:
  http_in     client send -> the completion handler runs (HTTP, parsing, validation)
  to_core     handler -> the engine core has the request (checks, the sender thread, the pipe)
  core_wait   the core has it -> its next step starts
  core_steps  that step's start -> the end of the step that returns the first token (n steps)
  from_core   -> the front end has the outputs (pickling, the pipe)
  build       -> the first SSE chunk is made (detokenization, logprob dicts, the chunk's JSON)
  http_out    -> the client reads that chunk
The offline TTFT to compare with is bench_offline_throughput.py --ttft-lens.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import metadata, write_json
from bench_offline_throughput import add_checkpoint_args, build_checkpoint
from fuzz_server import start_server

HOPS = ("http_in", "to_core", "core_wait", "core_steps", "from_core", "build", "http_out")


def read_events(trace_dir: Path) -> list[tuple[float, str, str]]:
    events = []
    for f in trace_dir.glob("*.log"):
        for line in f.read_text().splitlines():
            t, name = line.split(" ", 1)
            events.append((float(t), f.stem, name))
    return sorted(events)


def hops(t0: float, t_first: float, events: list[tuple[float, str, str]]) -> dict | None:
    """One request's hops from the events inside [t0, t_first] (requests run one at a time)."""
    window = [(t, pid, n) for t, pid, n in events if t0 <= t <= t_first]

    def first(pred, after: float):
        return next(((t, pid, n) for t, pid, n in window if t >= after and pred(n)), None)
    create = first(lambda n: n == "create", t0)
    added = create and first(lambda n: n.startswith("recv add"), create[0])
    if added is None:
        return None
    core = added[1]
    step0 = first(lambda n: n == "step_begin", added[0])
    done = step0 and next(((t, p, n) for t, p, n in window if t >= step0[0] and p == core and
                           n.startswith("step_end") and n.split()[1] != "0"), None)
    got = done and next(((t, p, n) for t, p, n in window if t >= done[0] and p != core and
                         n.startswith("recv outputs") and n != "recv outputs 0"), None)
    chunk = got and first(lambda n: n == "sse", got[0])
    if chunk is None:
        return None
    steps = sum(1 for t, p, n in window if p == core and n == "step_begin" and step0[0] <= t <= done[0])
    ms = [1e3 * x for x in (create[0] - t0, added[0] - create[0], step0[0] - added[0], done[0] - step0[0],
                            got[0] - done[0], chunk[0] - got[0], t_first - chunk[0])]
    return {**dict(zip(HOPS, ms)), "steps": steps, "ttft": 1e3 * (t_first - t0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_args(ap)
    ap.add_argument("--model", default=None, help="a checkpoint to serve instead of the random one")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--serve-args", default="", help="extra `vllm serve` flags, one shell-quoted string")
    ap.add_argument("--out", default="benchmarks/results/cpu/ttft_trace.json")
    args = ap.parse_args()
    meta = metadata(args.device)
    work = Path(tempfile.mkdtemp(prefix="ttft_trace_"))
    model = args.model
    if model is None:
        model = str(work / "model")
        hf, _ = build_checkpoint(args, Path(model))
        del hf  # the server needs the device's memory
        if args.device == "cuda":
            import torch
            torch.cuda.empty_cache()
    cfg = json.loads((Path(model) / "config.json").read_text())
    vocab = cfg.get("text_config", cfg)["vocab_size"]
    trace = work / "events"
    trace.mkdir()
    os.environ["TTFT_TRACE"] = str(trace)
    hook = str(Path(__file__).resolve().parent / "ttft_trace")
    os.environ["PYTHONPATH"] = os.pathsep.join([hook] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    # As the offline TTFT's engine: a short max_model_len, a few sequences.
    flags = [model, "--device", args.device, "--dtype", args.dtype, "--seed", str(args.seed), "--max-model-len",
             str(args.input_len + args.max_tokens + 8), "--max-num-seqs", "8", *shlex.split(args.serve_args)]
    proc, url = start_server(flags, api_key=None)
    try:
        with httpx.Client(timeout=120, trust_env=False) as client:
            model_id = client.get(url + "/v1/models").json()["data"][0]["id"]
            rng = random.Random(args.seed)
            times = []
            for i in range(args.requests + 2):  # the first two warm up
                body = {"model": model_id, "prompt": [rng.randrange(5, vocab) for _ in range(args.input_len)],
                        "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                        "logprobs": 0}
                t0, t_first = time.monotonic(), None
                with client.stream("POST", url + "/v1/completions", json=body) as resp:
                    resp.raise_for_status()
                    for line in resp.iter_lines():
                        if t_first is None and line.startswith("data:") and "[DONE]" not in line:
                            t_first = time.monotonic()
                if i >= 2:
                    times.append((t0, t_first))
                time.sleep(0.05)  # the core goes idle between requests, as at concurrency 1
    finally:
        proc.terminate()
        proc.wait(30)
    events = read_events(trace)
    rows = [h for t0, t1 in times if (h := hops(t0, t1, events)) is not None]
    if not rows:
        raise SystemExit(f"no request's hops were found in {trace}")
    medians = {k: float(np.median([r[k] for r in rows])) for k in (*HOPS, "steps", "ttft")}
    print(f"{len(rows)} of {len(times)} requests traced, prompt {args.input_len} tokens; median ms per hop:")
    for k in (*HOPS, "ttft"):
        print(f"  {k:11} {medians[k]:8.2f}")
    print(f"  steps       {medians['steps']:8.1f}  (the core's steps from the request's first to its first token)")
    path = write_json(args.out, {**meta, "benchmark": "trace_served_ttft", "config": vars(args),
                                 "median_ms": medians, "requests": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
