"""The speculation Pareto sweep on the built-in model: per-user tok/s against aggregate tok/s for no speculation,
ngram, DSpark at fixed K and DSpark with adaptive verification, at each concurrency; plus greedy losslessness on
held-out code completion (exact match against the real continuation, and identical tokens to no speculation).

    python benchmarks/bench_spec_pareto.py --out benchmarks/results/gpu/spec_pareto.json [--plot FILE.png]
    python benchmarks/bench_spec_pareto.py --plot-from spec_pareto.json --plot spec_pareto.png
    python benchmarks/bench_spec_pareto.py --configs none,dspark:3,dspark:3+r,...  # +r: with RecoverSSM

Workload: held-out standard-library code windows (the model and its draft never trained on them) as token
prompts of `--prompt-len`, greedy, `--output-len` tokens each. At concurrency c, max(c, `--min-requests`)
windows run as closed batches of c submitted at once to one engine, one batch after another, so that small
concurrencies are not one window's luck. Per (config, concurrency), over `--repeats` runs after a warm-up:
per-user tok/s is 1000 / median TPOT in ms, TPOT = (last token time - first token time) / (tokens - 1) of each
request, medianed over every request of every run; aggregate tok/s is output tokens / wall time of the batches,
medianed over runs. Configs run one engine at a time (each frees its device memory before the next starts).

Exact match: of the prompts, the fraction whose first `--answer-len` generated tokens equal the file's next
tokens; a lossless speculator gives the same fraction because it gives the same tokens, which is checked directly.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys

import numpy as np
import torch
from bench_common import metadata, stats, write_json
from bench_spec_builtin import timed_generate

from vllm import LLM, SamplingParams
from vllm.assets import DEFAULT_DSPARK_DIR
from vllm.tools.prepare_corpus import heldout_code_windows


def spec_config(name: str, draft: str) -> dict | None:
    """none | ngram:K | dspark:K | adaptive:K (DSpark with adaptive verification, K the most drafts a row); a
    `+r` suffix runs the config with RecoverSSM (--use-replayssm)."""
    if name == "none":
        return None
    method, k = name.removesuffix("+r").split(":")
    cfg = {"method": "ngram" if method == "ngram" else "dspark", "num_speculative_tokens": int(k)}
    if method != "ngram":
        cfg["model"] = draft
    if method == "adaptive":
        cfg["enable_adaptive_verification"] = True
    return cfg


def prompt_batches(windows: list[list[int]], concurrency: int, min_requests: int, prompt_len: int) -> list[list]:
    """max(c, min_requests) windows as closed batches of c prompts (each window's first prompt_len tokens)."""
    n = max(concurrency, min_requests)
    return [[{"prompt_token_ids": w[:prompt_len]} for w in windows[i:i + concurrency]]
            for i in range(0, n, concurrency)]


def tpots(outs: list) -> list[float]:
    return [(o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
            for o in outs if len(o.outputs[0].token_ids) > 1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--configs", default="none,dspark:3,adaptive:7,ngram:3,dspark:1,dspark:5,dspark:7,dspark:2,"
                                         "dspark:4,dspark:6")
    ap.add_argument("--draft", default=str(DEFAULT_DSPARK_DIR))
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--answer-len", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--min-requests", type=int, default=8, help="windows per concurrency at least (batches of c)")
    ap.add_argument("--async-scheduling", choices=["default", "on", "off"], default="default")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--max-num-seqs", type=int, default=64, help="the largest concurrency: fewer graphs to capture")
    ap.add_argument("--out", default="benchmarks/results/gpu/spec_pareto.json")
    ap.add_argument("--plot", help="write the Pareto plot (PNG) here")
    ap.add_argument("--plot-from", help="only plot an earlier run's JSON (the GPU machine has no matplotlib)")
    args = ap.parse_args(argv)
    if args.plot_from:
        plot(json.loads(open(args.plot_from).read())["rows"], args.plot)
        return
    concurrencies = [int(x) for x in args.concurrency.split(",")]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rows, plain, completions = [], {}, {}
    windows, report = None, {}
    async_scheduling = {"default": None, "on": True, "off": False}[args.async_scheduling]
    num_windows = max(max(concurrencies), args.min_requests)
    for name in args.configs.split(","):
        spec = spec_config(name, args.draft)
        llm = LLM(device=args.device, dtype=args.dtype, enforce_eager=args.enforce_eager, max_model_len=1024,
                  max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization,
                  speculative_config=spec, use_replayssm=name.endswith("+r"),
                  async_scheduling=None if spec is not None and spec["method"] == "ngram" else async_scheduling)
        if windows is None:
            windows = heldout_code_windows(llm.get_tokenizer(), [args.prompt_len + args.answer_len] * num_windows)
        for c in concurrencies:
            batches = prompt_batches(windows, c, args.min_requests, args.prompt_len)
            timed_generate(llm, batches[0], params, args.device)  # warm-up
            walls, per_token, outs = [], [], None
            for _ in range(args.repeats):
                wall, outs = 0.0, []
                for batch in batches:
                    dt, got = timed_generate(llm, batch, params, args.device)
                    wall += dt
                    outs += got
                walls.append(wall)
                per_token += tpots(outs)
            ids = [o.outputs[0].token_ids for o in outs]
            if name == "none":
                plain[c] = ids
            drafts = sum(o.metrics.spec_num_drafts for o in outs)
            accepted = sum(o.metrics.spec_num_accepted_tokens for o in outs)
            tokens = sum(len(i) for i in ids)
            row = {"config": name, "concurrency": c, "requests": len(outs), "async_scheduling":
                   llm.llm_engine.async_scheduling, "output_tokens": tokens, "wall_s": stats(walls),
                   "tpot_ms": stats([1000 * t for t in per_token]),
                   "per_user_tok_s": 1.0 / float(np.median(per_token)),
                   "aggregate_tok_s": tokens / float(np.median(walls)),
                   "mean_acceptance_length": (1 + accepted / drafts) if drafts else None,
                   "acceptance_rate_per_pos": [sum(col) / drafts for col in zip(
                       *(o.metrics.spec_num_accepted_tokens_per_pos for o in outs))] if drafts else None,
                   "identical_to_no_spec": ids == plain.get(c)}
            verifier = llm.llm_engine.runner.adaptive_verifier
            if verifier is not None:
                # Cumulative over the engine's life (warm-ups and earlier concurrencies included).
                row["adaptive_drafts_kept"] = verifier.num_kept / max(verifier.num_offered, 1)
                # What the budget weighed last: the host time per step (a moving average of the latest steps) and
                # the measured periods by step shape; how often it verified every draft to re-measure.
                if verifier.times is not None:
                    row["adaptive_host_step_ms"] = 1e3 * verifier.times.host
                    row["adaptive_step_periods_ms"] = verifier.times.summary_ms()
                row["adaptive_refreshed_steps"] = verifier.num_refreshed
                # The survival calibration's per-position ratios (observed / predicted) and the rows behind them.
                row["adaptive_calibration_scale"] = verifier.calibration.scale.tolist()
                row["adaptive_calibration_rows"] = verifier.calibration.num_rows
                row["adaptive_cost_tables_ms"] = {
                    "verify": {int(n): 1e3 * float(c) for n, c in zip(verifier.costs.verify.sizes,
                                                                       verifier.costs.verify.costs)},
                    "draft": {int(n): 1e3 * float(c) for n, c in zip(verifier.costs.draft.sizes,
                                                                      verifier.costs.draft.costs)}}
            rows.append(row)
            print({k: row[k] for k in ("config", "concurrency", "per_user_tok_s", "aggregate_tok_s",
                                       "mean_acceptance_length", "identical_to_no_spec")}, flush=True)
        completions[name] = ids
        del llm
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        # After every config, so that a run cut short keeps what it measured.
        report = results(rows, completions, [w[args.prompt_len:] for w in windows[:num_windows]],
                         args.answer_len, concurrencies)
        write_json(args.out, {"meta": metadata(args.device), "argv": sys.argv, "rows": rows, **report})
    print(report, flush=True)
    if args.plot:
        plot(rows, args.plot)


def results(rows: list[dict], completions: dict[str, list], answers: list[list[int]], answer_len: int,
            concurrencies: list[int]) -> dict:
    """Exact match of the first answer tokens and the mean matched prefix per config (at the last
    concurrency, every window once), and the per-concurrency summary."""
    return {"exact_match_first_answer_tokens": {name: float(np.mean([out[:answer_len] == ref for out, ref in
                                                                      zip(ids, answers)]))
                                                for name, ids in completions.items()},
            "mean_matched_prefix_tokens": {name: float(np.mean([matched_prefix(out, ref) for out, ref in
                                                                zip(ids, answers)]))
                                           for name, ids in completions.items()},
            "summary": summarise(rows, concurrencies)}


def matched_prefix(out: list[int], ref: list[int]) -> int:
    """How many leading tokens of the completion equal the file's continuation."""
    n = 0
    while n < min(len(out), len(ref)) and out[n] == ref[n]:
        n += 1
    return n


def summarise(rows: list[dict], concurrencies: list[int]) -> dict:
    """Per concurrency: the best fixed-K DSpark config, adaptive's per-user tok/s over it, and each config's
    speed-up over no speculation."""
    out = {}
    for c in concurrencies:
        at = {r["config"]: r for r in rows if r["concurrency"] == c}
        fixed = [r for n, r in at.items() if n.startswith("dspark:") and not n.endswith("+r")]
        best = max(fixed, key=lambda r: r["per_user_tok_s"]) if fixed else None
        entry = {"speedup_vs_no_spec": {n: r["per_user_tok_s"] / at["none"]["per_user_tok_s"]
                                        for n, r in at.items()} if "none" in at else {}}
        if best is not None:
            entry["best_fixed"] = best["config"]
            adaptive = [r for n, r in at.items() if n.startswith("adaptive:")]
            if adaptive:
                entry["adaptive_over_best_fixed"] = adaptive[0]["per_user_tok_s"] / best["per_user_tok_s"]
        # RecoverSSM against checkpoint columns, config by config: per-user and aggregate tok/s ratios.
        entry["recover_over_columns"] = {n: {"per_user": r["per_user_tok_s"] / at[n[:-2]]["per_user_tok_s"],
                                             "aggregate": r["aggregate_tok_s"] / at[n[:-2]]["aggregate_tok_s"]}
                                         for n, r in at.items() if n.endswith("+r") and n[:-2] in at}
        out[str(c)] = entry
    return out


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 6))
    for name in dict.fromkeys(r["config"] for r in rows):
        pts = [r for r in rows if r["config"] == name]
        ax.plot([r["aggregate_tok_s"] for r in pts], [r["per_user_tok_s"] for r in pts], marker="o", label=name,
                linewidth=2.5 if name.startswith(("adaptive", "none")) else 1,
                linestyle="--" if name.endswith("+r") else "-")
        for r in pts:
            ax.annotate(str(r["concurrency"]), (r["aggregate_tok_s"], r["per_user_tok_s"]), fontsize=6)
    ax.set_xscale("log")
    ax.set_xlabel("aggregate output tok/s")
    ax.set_ylabel("per-user tok/s (1000 / median TPOT ms)")
    ax.set_title("Speculation on the built-in model (labels: concurrency)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
