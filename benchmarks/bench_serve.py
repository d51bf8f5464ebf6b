"""Online serving benchmark: a bounded load of streaming /v1/completions requests against a running server.

    python -m vllm.entrypoints.cli.main serve --port 8123 --max-model-len 512 &
    python benchmarks/bench_serve.py --base-url http://127.0.0.1:8123 --num-prompts 64 --max-concurrency 16 \
        --input-len 64 --output-len 32 --out benchmarks/results/cpu/serve_cpu.json

The load generator is vllm/benchmarks/serve.py (also `vllm bench serve`); this script adds the loopback
check, the JSON record and the plots. Only loopback servers are accepted (127.0.0.0/8, localhost, ::1).
Prompts are random token ids in [5, --vocab-size) sent as `prompt: [ids]`, lengths uniform in
len*(1 -/+ --range-ratio); or, with --dataset FILE, random slices of the file's words. Requests arrive as a
Poisson process at --request-rate (inf: all at once), at most --max-concurrency in flight. Each request is
greedy with ignore_eos and exactly max_tokens wanted.
TTFT: send -> first chunk with non-empty text (or, with --every-token, with a token); ITL: gaps between later
such chunks; TPOT: (e2e - ttft) / (output_tokens - 1), output tokens from the final `usage` chunk (or the count
of text chunks without one).
Failed requests (HTTP errors, broken streams, the --timeout on the whole run) are counted, not fatal.
Writes JSON (bench_common metadata, summary in ms, per-request records) and a PNG of the latency CDFs.
"""
from __future__ import annotations

import argparse
import ipaddress
import math
import random
import sys
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import metadata, write_json

from vllm.benchmarks.serve import default_client_processes, latency_series, make_prompts, run_load_processes


def check_loopback(base_url: str) -> str:
    """The base URL without a trailing slash; ValueError unless it is http(s) to a loopback host."""
    u = urlparse(base_url)
    host = u.hostname or ""
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if u.scheme not in ("http", "https") or not ok:
        raise ValueError(f"--base-url {base_url!r}: only http(s) to a loopback host (127.0.0.0/8, localhost, ::1) "
                         "is allowed")
    return base_url.rstrip("/")


def summarize(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    a = np.asarray(xs, dtype=float) * 1e3
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "min": float(a.min()), "max": float(a.max()), "n": int(a.size)}


def plot(series: dict[str, list[float]], title: str, path: Path) -> None:
    fig, axes = plt.subplots(1, len(series), figsize=(4.2 * len(series), 3.6))
    for ax, (name, xs) in zip(axes, series.items()):
        a = np.sort(np.asarray(xs, dtype=float) * 1e3)
        if a.size:
            ax.step(a, np.arange(1, a.size + 1) / a.size, where="post")
            for q, ls in ((50, "--"), (99, ":")):
                ax.axvline(np.percentile(a, q), color="gray", ls=ls, lw=1, label=f"p{q} {np.percentile(a, q):.1f}")
            ax.legend(fontsize=8, loc="lower right")
        ax.set(title=f"{name} (n={a.size})", xlabel="ms", ylabel="CDF", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000", help="loopback only")
    ap.add_argument("--model", default=None, help="served model name (default: first of GET /v1/models)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per s (inf: all at once)")
    ap.add_argument("--max-concurrency", type=int, default=0, help="max requests in flight (0: unbounded)")
    ap.add_argument("--input-len", type=int, default=64, help="prompt tokens (words with --dataset)")
    ap.add_argument("--output-len", type=int, default=32, help="max_tokens")
    ap.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1-r) .. len*(1+r)")
    ap.add_argument("--vocab-size", type=int, default=500, help="random prompt ids are in [5, vocab-size)")
    ap.add_argument("--dataset", default=None, help="local text file: prompts are random slices of its words")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--every-token", action="store_true",
                    help="ask for logprobs=0, so that a chunk comes for every token even when its text is empty "
                         "(random models emit ids the tokenizer decodes to nothing)")
    ap.add_argument("--timeout", type=float, default=600.0, help="total seconds for the whole run")
    ap.add_argument("--client-processes", type=int, default=default_client_processes(),
                    help="client processes the requests are spread over (default: a quarter of the cores, 1-4); "
                         "their CPU use is reported, so a client near a full core shows")
    ap.add_argument("--out", default="benchmarks/results/cpu/serve_cpu.json")
    args = ap.parse_args(argv)
    try:
        base = check_loopback(args.base_url)
    except ValueError as e:
        ap.error(str(e))
    if (args.num_prompts < 1 or args.request_rate <= 0 or not 0 <= args.range_ratio < 1 or args.vocab_size <= 5
            or args.client_processes < 1):
        ap.error("need --num-prompts >= 1, --request-rate > 0, 0 <= --range-ratio < 1, --vocab-size > 5, "
                 "--client-processes >= 1")

    try:
        prompts = make_prompts(args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.vocab_size,
                               random.Random(args.seed), args.dataset)
    except ValueError as e:
        ap.error(str(e))
    recs, duration, args.model, client = run_load_processes(
        base, "/v1/completions", args.model, prompts, args.request_rate, args.max_concurrency, args.seed,
        args.timeout, args.every_token, num_processes=args.client_processes)
    ok = [r for r in recs if r.get("ok")]
    out_tokens = sum(r["output_tokens"] for r in ok)
    lat = latency_series(recs)
    tpot = lat["tpot"]
    series = {"TTFT": lat["ttft"], "TPOT": tpot, "ITL": lat["itl"], "E2E latency": lat["e2el"]}
    summary = {"completed": len(ok), "failed": len(recs) - len(ok), "duration_s": duration,
               "request_throughput": len(ok) / duration, "output_token_throughput": out_tokens / duration,
               "total_input_tokens": sum(r["prompt_len"] for r in ok), "total_output_tokens": out_tokens,
               "ttft_ms": summarize(series["TTFT"]), "tpot_ms": summarize(tpot), "itl_ms": summarize(series["ITL"]),
               "e2e_ms": summarize(series["E2E latency"]),
               "errors": dict(Counter(r["error"] for r in recs if not r.get("ok")).most_common(10)),
               "client": client}
    config = {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()}
    result = {**metadata("cpu"), "note": "device/threads describe the client machine, not the server",
              "config": config, "summary": summary,
              # start: the send time on the client's monotonic clock (one clock for all its processes)
              "requests": [{k: r.get(k) for k in ("prompt_len", "max_tokens", "output_tokens", "start", "ttft", "e2e",
                                                  "chunks", "error")} for r in recs]}
    path = write_json(args.out, result)
    png = path.with_suffix(".png")
    plot(series, f"{args.model} @ {base}: {len(ok)}/{len(recs)} ok, conc={args.max_concurrency or 'inf'}, "
                 f"rate={args.request_rate}, in={args.input_len} out={args.output_len}", png)
    print(f"completed {len(ok)}/{len(recs)} (failed {summary['failed']}) in {duration:.2f} s: "
          f"{summary['request_throughput']:.2f} req/s, {summary['output_token_throughput']:.1f} output tok/s")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = summary[key]
        if s["n"]:
            print(f"  {key:8s} mean {s['mean']:9.2f}  median {s['median']:9.2f}  p99 {s['p99']:9.2f}  (n={s['n']})")
    print(f"  client: {client['processes']} process(es), {client['cpu_s']:.2f} CPU s, busiest at "
          f"{100 * client['max_process_cpu_util']:.0f}% of a core")
    for err, n in summary["errors"].items():
        print(f"  error x{n}: {err}")
    print(f"wrote {path} and {png}")
    return result


if __name__ == "__main__":
    main()
