"""The online serving load generator behind `vllm bench serve` (and benchmarks/bench_serve.py): streaming
/v1/completions requests against a running server, Poisson arrivals, bounded concurrency, and upstream's metric
names for what it measures.

TTFT: send -> first chunk with non-empty text (or, with every_token, with a token); ITL: gaps between later
such chunks; TPOT: (e2e - ttft) / (output_tokens - 1), output tokens from the final `usage` chunk (or the count
of text chunks without one). Failed requests (HTTP errors, broken streams, the timeout on the whole run) are
counted, not fatal.

The HTTP client is aiohttp, as upstream's: a streamed request costs the client a ninth of the CPU it cost
with httpx (benchmarks/bench_http_client.py: 0.24 against 2.2 ms on a 2-core CI-class machine), and at a
closed loop's wave, when every stream ends at once, the client's per-request cost is how far the next wave's
sends spread. `run_load_processes` also spreads the requests over several client processes (each its own event
loop, share of the concurrency and of the arrival rate) and reports the CPU time they used.
"""
from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import aiohttp
import numpy as np


def make_prompts(num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                 rng: random.Random, dataset: str | None = None) -> list[tuple[object, int, int]]:
    """(prompt, prompt_len, max_tokens) per request: random token ids in [5, vocab_size), or random slices of a
    text file's words; lengths uniform in len * (1 -/+ range_ratio)."""
    def length(n: int) -> int:
        return max(1, rng.randint(math.floor(n * (1 - range_ratio)), math.ceil(n * (1 + range_ratio))))
    words = Path(dataset).read_text(errors="replace").split() if dataset else None
    if words is not None and not words:
        raise ValueError(f"dataset {dataset}: no words")
    out = []
    for _ in range(num_prompts):
        n, m = length(input_len), length(output_len)
        if words is None:
            out.append(([rng.randrange(5, vocab_size) for _ in range(n)], n, m))
        else:
            start = rng.randrange(max(1, len(words) - n + 1))
            out.append((" ".join(words[start:start + n]), n, m))
    return out


async def one_request(session: aiohttp.ClientSession, url: str, model: str, prompt, prompt_len: int,
                      max_tokens: int, rec: dict, every_token: bool = False, ignore_eos: bool = True) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": ignore_eos,
            "stream": True, "stream_options": {"include_usage": True}}
    if every_token:  # the sampled token's logprob rides in every chunk, so tokens without text are seen too
        body["logprobs"] = 0
    rec.update(prompt_len=prompt_len, max_tokens=max_tokens, ok=False, itl=[], chunks=0, usage_tokens=None)
    t0 = rec["start"] = time.perf_counter()
    last = None
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                text = (await resp.read()).decode(errors="replace")
                rec["error"] = f"HTTP {resp.status}: {text[:200]}"
                return
            async for raw in resp.content:  # one line at a time
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
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


def _session() -> aiohttp.ClientSession:
    """No connection limit, no total timeout (run_load bounds the run), no proxy from the environment; a
    response is read a line at a time, up to twice read_bufsize."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None),
                                 trust_env=False, read_bufsize=1 << 20)  # SSE lines up to 2 MiB


async def first_model(session: aiohttp.ClientSession, base: str) -> str:
    async with session.get(base + "/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as r:
        r.raise_for_status()
        return (await r.json())["data"][0]["id"]


async def run_load(base: str, endpoint: str, model: str | None, prompts, request_rate: float, max_concurrency: int,
                   seed: int, timeout: float, every_token: bool = False, ignore_eos: bool = True,
                   ready: Callable[[], object] | None = None) -> tuple[list[dict], float, str]:
    """(per-request records, wall seconds, model name) for one run of `prompts`. `ready` (blocking) runs just
    before the first request: the client processes' start barrier."""
    rng = random.Random(seed + 1)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency > 0 else None
    recs: list[dict] = [{} for _ in prompts]
    async with _session() as client:
        model = model or await first_model(client, base)

        async def limited(i: int, p) -> None:
            if sem is None:
                return await one_request(client, base + endpoint, model, *p, recs[i], every_token, ignore_eos)
            async with sem:
                await one_request(client, base + endpoint, model, *p, recs[i], every_token, ignore_eos)

        if ready is not None:
            ready()
        t_start = time.perf_counter()
        tasks = []

        async def launch() -> None:
            for i, p in enumerate(prompts):
                tasks.append(asyncio.create_task(limited(i, p)))
                if request_rate != math.inf and i + 1 < len(prompts):
                    await asyncio.sleep(rng.expovariate(request_rate))
            await asyncio.gather(*tasks)

        try:
            await asyncio.wait_for(launch(), timeout=timeout)
        except asyncio.TimeoutError:
            pass
        duration = time.perf_counter() - t_start
    for r in recs:
        if not r.get("ok") and "error" not in r:
            r["error"] = f"not finished within the timeout of {timeout} s"
    return recs, duration, model


START_TIMEOUT_S = 300.0  # for every client process to be ready; one that died breaks the barrier for all


def default_client_processes() -> int:
    """A quarter of the machine's cores, 1 to 4: enough clients for 64+ streams on a GPU host, one on a small
    box where the server needs the cores."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def _client_process(conn, start, base: str, endpoint: str, model: str, prompts, request_rate: float,
                    max_concurrency: int, seed: int, timeout: float, every_token: bool, ignore_eos: bool) -> None:
    cpu0 = time.process_time()
    try:
        recs, duration, _ = asyncio.run(run_load(base, endpoint, model, prompts, request_rate, max_concurrency,
                                                 seed, timeout, every_token, ignore_eos,
                                                 ready=lambda: start.wait(START_TIMEOUT_S)))
        conn.send((recs, duration, time.process_time() - cpu0, None))
    except BaseException as e:  # noqa: BLE001 -- the parent reports it; a worker never hangs the run
        conn.send(([], 0.0, time.process_time() - cpu0, f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def run_load_processes(base: str, endpoint: str, model: str | None, prompts, request_rate: float,
                       max_concurrency: int, seed: int, timeout: float, every_token: bool = False,
                       ignore_eos: bool = True, num_processes: int = 1) -> tuple[list[dict], float, str, dict]:
    """run_load over `num_processes` client processes: request i goes to process i % N, each process gets
    1/N of the arrival rate (Poisson streams add up to the total rate) and its share of max_concurrency (0:
    unbounded). Returns (records in prompt order, wall seconds from the first send to the last finish, model,
    client stats: processes, CPU seconds in all, the busiest process's CPU share of its wall time)."""
    n = max(1, min(num_processes, len(prompts), max_concurrency if max_concurrency > 0 else len(prompts)))
    if model is None:
        model = asyncio.run(_first_model(base))
    if n == 1:
        cpu0 = time.process_time()
        recs, duration, model = asyncio.run(run_load(base, endpoint, model, prompts, request_rate, max_concurrency,
                                                     seed, timeout, every_token, ignore_eos))
        cpu = time.process_time() - cpu0
        return recs, duration, model, {"processes": 1, "cpu_s": cpu, "max_process_cpu_util": cpu / duration}
    ctx = multiprocessing.get_context("spawn")
    # Each process imports for a second or more, and not all equally fast: without a common start the first
    # ones run alone for a while, the load never reaches max_concurrency and the wall time counts the stagger.
    start = ctx.Barrier(n)
    procs, conns = [], []
    for i in range(n):
        conc = 0 if max_concurrency <= 0 else max_concurrency // n + (i < max_concurrency % n)
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_client_process, daemon=True,
                        args=(send, start, base, endpoint, model, prompts[i::n], request_rate / n, conc,
                              seed + 1000 * i, timeout, every_token, ignore_eos))
        p.start()
        send.close()
        procs.append(p)
        conns.append(recv)
    recs: list[dict] = [{} for _ in prompts]
    cpu, utils, errors = 0.0, [], []
    for i, (p, conn) in enumerate(zip(procs, conns)):
        try:
            part, duration, cpu_s, error = conn.recv() if conn.poll(timeout + 60) else ([], 0.0, 0.0, "no answer")
        except EOFError:
            part, duration, cpu_s, error = [], 0.0, 0.0, f"client process died (exit code {p.exitcode})"
        p.join(10)
        if p.is_alive():
            p.kill()
        recs[i::n] = part or [{"error": f"client process {i}: {error}"} for _ in prompts[i::n]]
        cpu += cpu_s
        utils.append(cpu_s / duration if duration else 0.0)
        if error:
            errors.append(error)
    starts = [r["start"] for r in recs if "start" in r]
    ends = [r["start"] + r["e2e"] for r in recs if "e2e" in r]
    wall = (max(ends) - min(starts)) if starts and ends else 0.0
    stats = {"processes": n, "cpu_s": cpu, "max_process_cpu_util": max(utils), "errors": errors}
    return recs, max(wall, 1e-9), model, stats


async def _first_model(base: str) -> str:
    async with _session() as session:
        return await first_model(session, base)


def latency_series(recs: list[dict]) -> dict[str, list[float]]:
    """Seconds per request (ttft, tpot, e2el) and per token gap (itl), of the requests that completed."""
    ok = [r for r in recs if r.get("ok")]
    return {"ttft": [r["ttft"] for r in ok],
            "tpot": [(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1],
            "itl": [x for r in ok for x in r["itl"]], "e2el": [r["e2e"] for r in ok]}


def serving_metrics(recs: list[dict], duration: float, percentiles: tuple[float, ...] = (99,)) -> dict:
    """Upstream's result names: completed, throughputs, and mean/median/std/pN of ttft, tpot, itl, e2el in ms."""
    ok = [r for r in recs if r.get("ok")]
    inputs, outputs = sum(r["prompt_len"] for r in ok), sum(r["output_tokens"] for r in ok)
    out = {"duration": duration, "completed": len(ok), "failed": len(recs) - len(ok), "total_input_tokens": inputs,
           "total_output_tokens": outputs, "request_throughput": len(ok) / duration,
           "output_throughput": outputs / duration, "total_token_throughput": (inputs + outputs) / duration}
    for name, xs in latency_series(recs).items():
        a = np.asarray(xs, dtype=float) * 1e3
        out[f"mean_{name}_ms"] = float(a.mean()) if a.size else None
        out[f"median_{name}_ms"] = float(np.median(a)) if a.size else None
        out[f"std_{name}_ms"] = float(a.std()) if a.size else None
        for p in percentiles:
            out[f"p{p:g}_{name}_ms"] = float(np.percentile(a, p)) if a.size else None
    out["errors"] = dict(Counter(r["error"] for r in recs if not r.get("ok")).most_common(10))
    return out
