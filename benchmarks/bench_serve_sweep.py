"""`vllm serve` latency and throughput at several concurrencies, on the offline benchmark's random checkpoint.

    python benchmarks/bench_serve_sweep.py --device cuda --config benchmarks/configs/kimi-linear-1b3.json \
        --dtype bfloat16 --concurrency 1,16,64 --input-len 256 --output-len 128 \
        --offline-json benchmarks/results/gpu/offline_throughput_cuda.json --out benchmarks/results/gpu/serve_sweep.json

Writes the checkpoint bench_offline_throughput.py writes (same --config and --seed: the same weights), starts
`vllm serve` on it (its defaults, plus --serve-args), and runs bench_serve.py against it once per concurrency:
4 x concurrency requests (at least 16), all sent at once, at most `concurrency` in flight, greedy, exactly
--output-len tokens each, with logprobs=0 so that every token comes in a chunk (bench_serve.py --every-token:
most ids of a random model decode to no text with the built-in tokenizer). With --offline-json (a result of
bench_offline_throughput.py from the same machine and checkpoint), the served output throughput at each
concurrency is set against the offline figure at that batch size. `--also-without-logprobs` adds a round per
concurrency without logprobs, as the offline benchmark runs (its throughput compares with offline; its TTFT
waits for text). Each level also records the CPU time that the server's front-end process, its engine core
process and this process (the benchmark client) spent during it, over the level's wall time: a process near
1.0 is the bottleneck (each is one Python thread doing most of the work). Writes JSON (each level's
bench_serve summary) and a PNG of TTFT, TPOT and throughput.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve
from bench_common import metadata, write_json
from bench_offline_throughput import add_checkpoint_args, build_checkpoint
from fuzz_server import start_server, stop_server


def plot(levels: list[dict], meta: dict, title: str, png: Path) -> None:
    conc = [lv["concurrency"] for lv in levels]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, label in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        for stat in ("median", "p99"):
            ax.plot(conc, [lv["summary"][key].get(stat, float("nan")) for lv in levels], marker="o", label=stat)
        ax.set(xscale="log", xlabel="concurrency", ylabel="ms", title=label)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    ax = axes[2]
    ax.plot(conc, [lv["summary"]["output_token_throughput"] for lv in levels], marker="o", label="served")
    offline = [lv.get("offline_tokens_per_s") for lv in levels]
    if any(v is not None for v in offline):
        ax.plot(conc, [v if v is not None else float("nan") for v in offline], marker="s", label="offline, same batch")
    ax.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="output tokens/s", title="throughput")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.suptitle(f"{title} - {meta['device_name']}, commit {meta['git_commit'][:12]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):  # a process that ended meanwhile
            continue
    return children


def server_processes(server_pid: int) -> dict[str, list[int]]:
    """The front end's processes and the rest (the engine core, helpers). With --api-server-count N the front ends
    are the `vllm serve` process's children that lead process groups of their own (api_server_procs.py)."""
    children = child_pids(server_pid)
    api_servers = [p for p in children if os.getpgid(p) == p]
    if api_servers:
        return {"front_end": api_servers, "engine_core": [p for p in children if p not in api_servers]}
    return {"front_end": [server_pid], "engine_core": children}


def cpu_utilization(run, server_pid: int):
    """run()'s result and, per process, CPU seconds over wall seconds while it ran (with several API servers,
    front_end sums them and front_end_each lists them)."""
    procs = server_processes(server_pid)
    each0 = [cpu_seconds(p) for p in procs["front_end"]]
    before = {k: sum(cpu_seconds(p) for p in pids) for k, pids in procs.items()}
    client0, t0 = time.process_time(), time.monotonic()
    result = run()
    # Over the load's own duration (first send to last finish), not the call's: the call also spawns the client
    # processes, whose seconds of imports the idle server would otherwise be averaged over.
    wall = result.get("summary", {}).get("duration_s") or time.monotonic() - t0
    used = {k: (sum(cpu_seconds(p) for p in pids) - before[k]) / wall for k, pids in procs.items()}
    if len(each0) > 1:
        used["front_end_each"] = [(cpu_seconds(p) - c0) / wall for p, c0 in zip(procs["front_end"], each0)]
    # The load generator's own processes report their CPU seconds (bench_serve's summary["client"]).
    client = (result.get("summary", {}).get("client") or {}).get("cpu_s")
    used["client"] = (time.process_time() - client0 if client is None else client) / wall
    return result, {k: [round(x, 3) for x in v] if isinstance(v, list) else round(v, 3) for k, v in used.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_args(ap)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--serve-args", default="", help="extra `vllm serve` flags, one shell-quoted string")
    ap.add_argument("--offline-json", default=None, help="bench_offline_throughput.py result to compare with")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--also-without-logprobs", action="store_true",
                    help="at each concurrency, also a round without logprobs (as the offline benchmark runs): its "
                         "throughput is comparable, its TTFT counts to the first chunk with text")
    ap.add_argument("--out", default="benchmarks/results/cpu/serve_sweep_cpu.json")
    args = ap.parse_args()
    meta = metadata(args.device)
    levels = [int(c) for c in args.concurrency.split(",")]
    P, O = args.input_len, args.output_len  # noqa: E741 - prompt and output lengths
    tmp = Path(tempfile.mkdtemp(prefix="bench_serve_sweep_"))
    hf, cfg = build_checkpoint(args, tmp)
    del hf
    torch.cuda.empty_cache() if args.device == "cuda" else None
    offline = {}
    if args.offline_json:
        for row in json.loads(Path(args.offline_json).read_text())["results"]:
            offline[row["batch_size"]] = row["ours"]["tokens_per_s"]
    serve_flags = ["--dtype", args.dtype, "--device", args.device, "--seed", str(args.seed), "--max-model-len",
                   str(P + O + 8), "--max-num-seqs", str(max(levels)), *shlex.split(args.serve_args)]
    t0 = time.monotonic()
    proc, url = start_server([str(tmp), *serve_flags], api_key=None, timeout=args.startup_timeout)
    startup_s = time.monotonic() - t0
    print(f"server healthy after {startup_s:.1f} s", flush=True)
    results = []
    try:
        for c in levels:
            n = max(16, 4 * c)
            # One short warm-up round at this concurrency first: the first requests pay one-time costs.
            common = ["--base-url", url, "--max-concurrency", str(c), "--input-len", str(P), "--output-len", str(O),
                      "--vocab-size", str(cfg["vocab_size"]), "--seed", str(args.seed)]
            bench_serve.main(common + ["--every-token", "--num-prompts", str(c),
                                       "--out", str(tmp / f"warmup_{c}.json")])
            res, cpu = cpu_utilization(lambda: bench_serve.main(common + [
                "--every-token", "--num-prompts", str(n), "--out", str(tmp / f"level_{c}.json")]), proc.pid)
            print(f"CPU time over wall time: {cpu}", flush=True)
            level = {"concurrency": c, "num_prompts": n, "summary": res["summary"], "cpu_utilization": cpu}
            if args.also_without_logprobs:
                plain = bench_serve.main(common + ["--num-prompts", str(n), "--out", str(tmp / f"plain_{c}.json")])
                level["summary_without_logprobs"] = plain["summary"]
            if c in offline:
                level["offline_tokens_per_s"] = offline[c]
                level["served_over_offline"] = res["summary"]["output_token_throughput"] / offline[c]
                if args.also_without_logprobs:
                    level["served_without_logprobs_over_offline"] = \
                        plain["summary"]["output_token_throughput"] / offline[c]
            results.append(level)
    finally:
        stop_server(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    data = {**meta, "benchmark": "serve_sweep", "config": {**vars(args), "model_config": cfg},
            "serve_flags": serve_flags, "server_startup_s": startup_s, "levels": results}
    path = write_json(args.out, data)
    name = "tiny Kimi-Linear" if args.config == "tiny" else Path(args.config).stem
    plot(results, meta, f"vllm serve, {name}, {args.dtype}, in {P}, out {O}", path.with_suffix(".png"))
    for lv in results:
        s = lv["summary"]
        ratio = f", {lv['served_over_offline']:.2f}x offline" if "served_over_offline" in lv else ""
        print(f"concurrency {lv['concurrency']:>3}: TTFT median {s['ttft_ms'].get('median', float('nan')):8.1f} ms, "
              f"TPOT median {s['tpot_ms'].get('median', float('nan')):7.2f} ms, "
              f"{s['output_token_throughput']:9.1f} output tok/s{ratio} ({s['failed']} failed)")
        if "summary_without_logprobs" in lv:
            plain = lv["summary_without_logprobs"]
            ratio = (f", {lv['served_without_logprobs_over_offline']:.2f}x offline"
                     if "served_without_logprobs_over_offline" in lv else "")
            print(f"    without logprobs: {plain['output_token_throughput']:9.1f} output tok/s{ratio} "
                  f"({plain['failed']} failed)")
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
