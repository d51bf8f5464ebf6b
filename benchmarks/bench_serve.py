"""Online serving benchmark: a bounded load of streaming /v1/completions requests against a running server.

    python -m vllm.entrypoints.cli.main serve --port 8123 --max-model-len 512 &
    python benchmarks/bench_serve.py --base-url http://127.0.0.1:8123 --num-prompts 64 --max-concurrency 16 \
        --input-len 64 --output-len 32 --out benchmarks/results/cpu/serve_cpu.json

Only loopback servers are accepted (127.0.0.0/8, localhost, ::1). Prompts are random token ids in
[5, --vocab-size) sent as `prompt: [ids]`, lengths uniform in len*(1 -/+ --range-ratio); or, with --dataset FILE,
random slices of the file's words. Requests arrive as a Poisson process at --request-rate (inf: all at once),
at most --max-concurrency in flight. Each request is greedy with ignore_eos and exactly max_tokens wanted.
TTFT: send -> first chunk with non-empty text (or, with --every-token, with a token); ITL: gaps between later
such chunks; TPOT: (e2e - ttft) / (output_tokens - 1), output tokens from the final `usage` chunk (or the count
of text chunks without one).
Failed requests (HTTP errors, broken streams, the --timeout on the whole run) are counted, not fatal.
Writes JSON (bench_common metadata, summary in ms, per-request records) and a PNG of the latency CDFs.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import random
import sys
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

import httpx
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import metadata, write_json


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


def make_prompts(args, rng: random.Random) -> list[tuple[object, int, int]]:
    """(prompt, prompt_len, max_tokens) per request."""
    def length(n: int) -> int:
        return max(1, rng.randint(math.floor(n * (1 - args.range_ratio)), math.ceil(n * (1 + args.range_ratio))))
    words = Path(args.dataset).read_text(errors="replace").split() if args.dataset else None
    if words is not None and not words:
        raise ValueError(f"--dataset {args.dataset}: no words")
    out = []
    for _ in range(args.num_prompts):
        n, m = length(args.input_len), length(args.output_len)
        if words is None:
            out.append(([rng.randrange(5, args.vocab_size) for _ in range(n)], n, m))
        else:
            start = rng.randrange(max(1, len(words) - n + 1))
            out.append((" ".join(words[start:start + n]), n, m))
    return out


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt, prompt_len: int, max_tokens: int,
                      rec: dict, every_token: bool = False) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if every_token:  # the sampled token's logprob rides in every chunk, so tokens without text are seen too
        body["logprobs"] = 0
    rec.update(prompt_len=prompt_len, max_tokens=max_tokens, ok=False, itl=[], chunks=0, usage_tokens=None)
    t0 = rec["start"] = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec["error"] = f"HTTP {resp.status_code}: {text[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    rec["error"] = f"stream error: {str(msg['error'])[:200]}"
                    return
                now = time.perf_counter()
                choice = msg["choices"][0] if msg.get("choices") else {}
                if choice.get("text") or (choice.get("logprobs") or {}).get("tokens"):
                    rec["chunks"] += 1
                    if last is None:
                        rec["ttft"] = now - t0
                    else:
                        rec["itl"].append(now - last)
                    last = now
                if msg.get("usage"):
                    rec["usage_tokens"] = msg["usage"].get("completion_tokens")
        rec["e2e"] = time.perf_counter() - t0
        rec["output_tokens"] = rec["usage_tokens"] if rec["usage_tokens"] is not None else rec["chunks"]
        if "ttft" not in rec:
            rec["error"] = "no non-empty text chunk"
            return
        rec["ok"] = True
    except Exception as e:  # noqa: BLE001 -- any failure is this request's, counted and reported
        rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"


async def run_load(args, base: str, prompts) -> tuple[list[dict], float]:
    rng = random.Random(args.seed + 1)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency > 0 else None
    recs: list[dict] = [{} for _ in prompts]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits, trust_env=False) as client:
        model = args.model
        if model is None:
            r = await client.get(base + "/v1/models", timeout=30)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        args.model = model

        async def limited(i: int, p) -> None:
            if sem is None:
                return await one_request(client, base + "/v1/completions", model, *p, recs[i], args.every_token)
            async with sem:
                await one_request(client, base + "/v1/completions", model, *p, recs[i], args.every_token)

        t_start = time.perf_counter()
        tasks = []

        async def launch() -> None:
            for i, p in enumerate(prompts):
                tasks.append(asyncio.create_task(limited(i, p)))
                if args.request_rate != math.inf and i + 1 < len(prompts):
                    await asyncio.sleep(rng.expovariate(args.request_rate))
            await asyncio.gather(*tasks)

        try:
            await asyncio.wait_for(launch(), timeout=args.timeout)
        except asyncio.TimeoutError:
            pass
        duration = time.perf_counter() - t_start
    for r in recs:
        if not r.get("ok") and "error" not in r:
            r["error"] = f"not finished within --timeout {args.timeout} s"
    return recs, duration


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
    ap.add_argument("--out", default="benchmarks/results/cpu/serve_cpu.json")
    args = ap.parse_args(argv)
    try:
        base = check_loopback(args.base_url)
    except ValueError as e:
        ap.error(str(e))
    if args.num_prompts < 1 or args.request_rate <= 0 or not 0 <= args.range_ratio < 1 or args.vocab_size <= 5:
        ap.error("need --num-prompts >= 1, --request-rate > 0, 0 <= --range-ratio < 1, --vocab-size > 5")

    prompts = make_prompts(args, random.Random(args.seed))
    recs, duration = asyncio.run(run_load(args, base, prompts))
    ok = [r for r in recs if r.get("ok")]
    out_tokens = sum(r["output_tokens"] for r in ok)
    tpot = [(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    series = {"TTFT": [r["ttft"] for r in ok], "TPOT": tpot, "ITL": [x for r in ok for x in r["itl"]],
              "E2E latency": [r["e2e"] for r in ok]}
    summary = {"completed": len(ok), "failed": len(recs) - len(ok), "duration_s": duration,
               "request_throughput": len(ok) / duration, "output_token_throughput": out_tokens / duration,
               "total_input_tokens": sum(r["prompt_len"] for r in ok), "total_output_tokens": out_tokens,
               "ttft_ms": summarize(series["TTFT"]), "tpot_ms": summarize(tpot), "itl_ms": summarize(series["ITL"]),
               "e2e_ms": summarize(series["E2E latency"]),
               "errors": dict(Counter(r["error"] for r in recs if not r.get("ok")).most_common(10))}
    config = {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()}
    result = {**metadata("cpu"), "note": "device/threads describe the client machine, not the server",
              "config": config, "summary": summary,
              "requests": [{k: r.get(k) for k in ("prompt_len", "max_tokens", "output_tokens", "ttft", "e2e",
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
    for err, n in summary["errors"].items():
        print(f"  error x{n}: {err}")
    print(f"wrote {path} and {png}")
    return result


if __name__ == "__main__":
    main()
