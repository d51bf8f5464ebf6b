"""Multi-turn chat through `vllm serve`, prefix caching on and off: time to first token per turn, throughput, and
what caching costs a workload that shares nothing.

    python benchmarks/bench_multi_turn.py --out benchmarks/results/gpu/<date>_<card>_multi_turn.json \
        --conversations 16 --turns 10 --system-len 2048 --user-len 512 --output-len 64 --max-model-len 8192

For each setting (caching on, then off) the script starts a server on loopback, waits for /health, runs:
- the conversations: --conversations at once, each --turns turns; every prompt is the whole history (a shared
  --system-len token system prompt, then each turn's --user-len token user message and the answer before it,
  as the token ids the server returned), streamed greedy with ignore_eos and --output-len tokens;
- the unshared workload: --unshared-prompts random prompts of the same total length as the conversations'
  mean, nothing in common, at --conversations concurrency (answers compared on the first run);
then stops the server. Prompts are random token ids (seeded), so both settings see the same requests and, being
greedy, give the same answers (checked: a different answer is reported as a divergence).
Reported per turn: the median TTFT over conversations and the cached tokens; per workload: output tokens/s (the
unshared one: the median of --unshared-repeats runs, each of fresh prompts).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import metadata, write_json


async def stream(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    t0 = time.perf_counter()
    rec = {"prompt_len": len(prompt), "token_ids": [], "cached": None}
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            msg = json.loads(line[5:])
            if "error" in msg:
                raise RuntimeError(f"stream error: {msg['error']}")
            for choice in msg.get("choices") or []:
                ids = choice.get("token_ids") or []
                if ids and "ttft" not in rec:
                    rec["ttft"] = time.perf_counter() - t0
                rec["token_ids"] += ids
            if msg.get("usage"):
                rec["cached"] = (msg["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    rec["e2e"] = time.perf_counter() - t0
    return rec


async def conversations(base: str, model: str, a, rng: random.Random) -> list[list[dict]]:
    system = [rng.randrange(5, a.vocab_size) for _ in range(a.system_len)]
    users = [[[rng.randrange(5, a.vocab_size) for _ in range(a.user_len)] for _ in range(a.turns)]
             for _ in range(a.conversations)]

    async def one(client: httpx.AsyncClient, c: int) -> list[dict]:
        history, recs = list(system), []
        for t in range(a.turns):
            prompt = history + users[c][t]
            rec = await stream(client, base + "/v1/completions", model, prompt, a.output_len)
            recs.append(rec)
            history = prompt + rec["token_ids"]
        return recs

    async with httpx.AsyncClient(timeout=httpx.Timeout(None), trust_env=False) as client:
        return await asyncio.gather(*(one(client, c) for c in range(a.conversations)))


async def unshared(base: str, model: str, a, length: int, rng: random.Random) -> tuple[list[dict], float]:
    prompts = [[rng.randrange(5, a.vocab_size) for _ in range(length)] for _ in range(a.unshared_prompts)]
    sem = asyncio.Semaphore(a.conversations)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), trust_env=False) as client:
        async def one(p):
            async with sem:
                return await stream(client, base + "/v1/completions", model, p, a.output_len)
        t0 = time.perf_counter()
        recs = await asyncio.gather(*(one(p) for p in prompts))
        return recs, time.perf_counter() - t0


def start_server(a, caching: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--host", "127.0.0.1", "--port", str(a.port),
           "--max-model-len", str(a.max_model_len), "--disable-log-requests", "--enable-prompt-tokens-details",
           "--enable-prefix-caching" if caching else "--no-enable-prefix-caching", *a.server_args.split()]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + a.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(f"http://127.0.0.1:{a.port}/health", timeout=2, trust_env=False).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("the server did not come up")


def run_setting(a, caching: bool) -> dict:
    proc = start_server(a, caching)
    base = f"http://127.0.0.1:{a.port}"
    try:
        model = httpx.get(base + "/v1/models", trust_env=False).json()["data"][0]["id"]
        t0 = time.perf_counter()
        convs = asyncio.run(conversations(base, model, a, random.Random(a.seed)))
        conv_s = time.perf_counter() - t0
        mean_len = round(statistics.mean(r["prompt_len"] for c in convs for r in c))
        runs = [asyncio.run(unshared(base, model, a, mean_len, random.Random(a.seed + 1 + i)))
                for i in range(a.unshared_repeats)]  # fresh prompts each time: nothing to hit
        rates = [sum(len(r["token_ids"]) for r in recs) / secs for recs, secs in runs]
        flat, flat_s = runs[0]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    per_turn = [{"turn": t + 1, "history_tokens": round(statistics.mean(c[t]["prompt_len"] for c in convs)),
                 "ttft_ms_median": 1e3 * statistics.median(c[t]["ttft"] for c in convs),
                 "cached_tokens_mean": statistics.mean(c[t]["cached"] or 0 for c in convs)}
                for t in range(a.turns)]
    out_tokens = sum(len(r["token_ids"]) for c in convs for r in c)
    return {"caching": caching, "per_turn": per_turn, "conversations_s": conv_s,
            "conversations_output_tok_s": out_tokens / conv_s,
            "unshared_prompt_len": mean_len, "unshared_s": flat_s, "unshared_output_tok_s_runs": rates,
            "unshared_output_tok_s": statistics.median(rates),
            "answers": [[r["token_ids"] for r in c] for c in convs], "unshared_answers": [r["token_ids"] for r in flat]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--user-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--unshared-prompts", type=int, default=64)
    ap.add_argument("--unshared-repeats", type=int, default=3, help="runs of the unshared workload (median)")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--vocab-size", type=int, default=4000, help="prompt ids are in [5, vocab-size)")
    ap.add_argument("--server-args", default="", help="more `vllm serve` flags, space-separated")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="for the record only: where the server runs")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    on, off = run_setting(a, True), run_setting(a, False)
    same = on.pop("answers") == off.pop("answers")
    same_unshared = on.pop("unshared_answers") == off.pop("unshared_answers")
    last_on, last_off = on["per_turn"][-1], off["per_turn"][-1]
    summary = {"answers_identical": same, "unshared_answers_identical": same_unshared,
               "last_turn_history_tokens": last_on["history_tokens"],
               "last_turn_ttft_ratio_on_off": last_on["ttft_ms_median"] / last_off["ttft_ms_median"],
               "conversations_throughput_ratio_on_off": on["conversations_output_tok_s"]
               / off["conversations_output_tok_s"],
               "unshared_throughput_ratio_on_off": on["unshared_output_tok_s"] / off["unshared_output_tok_s"]}
    path = write_json(a.out, {**metadata(a.device), "config": vars(a), "summary": summary, "on": on, "off": off})
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for r, label in ((on, "prefix caching on"), (off, "off")):
        ax.plot([t["turn"] for t in r["per_turn"]], [t["ttft_ms_median"] for t in r["per_turn"]], marker="o",
                label=label)
    ax.set(xlabel="turn", ylabel="median TTFT (ms)", title=f"{a.conversations} conversations, system "
           f"{a.system_len}, +{a.user_len}+{a.output_len} per turn ({a.device})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    print(json.dumps(summary, indent=1))
    for t_on, t_off in zip(on["per_turn"], off["per_turn"]):
        print(f"turn {t_on['turn']:2d}  history {t_on['history_tokens']:6d}  TTFT on {t_on['ttft_ms_median']:8.1f} ms"
              f"  off {t_off['ttft_ms_median']:8.1f} ms  cached {t_on['cached_tokens_mean']:8.1f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
