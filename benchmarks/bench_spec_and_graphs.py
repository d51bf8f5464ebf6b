"""Decode step time eager vs FULL_DECODE_ONLY CUDA graphs, and tokens/s with and without ngram speculation.

    python benchmarks/bench_spec_and_graphs.py --device cuda --config /work/shared/bench/kimi-linear-1b3.json \
        --dtype bfloat16 --out benchmarks/results/gpu/spec_and_graphs.json

Part 1 (`steps`): for each batch size B, B requests are prefilled, then `--decode-steps` engine steps are timed
one by one (scheduling, input preparation, forward, sampling, output processing: what a user waits for per
token). Eager and graph engines load the same checkpoint and alternate per batch size; the figure is the median
step time and eager / graphs. Part 2 (`spec`): repetitive prompts (a random phrase repeated), greedy, at
concurrency 1 and 16, with and without `--speculative-config ngram` (K = `--num-spec`), both with graphs unless
--enforce-eager: output tokens/s of the whole generate call (median of `--repeats`), the speed-up, the mean
acceptance length and the check that outputs are identical (speculation is lossless). The checkpoint is random
(bench_offline_throughput.build_checkpoint): ngram acceptance is whatever a random model's greedy text repeats,
so a third row, `oracle`, drafts the plain run's own continuation: every draft is accepted while the speculative
run tracks the plain one (in fp32; in bf16 verify rows round differently and the runs drift apart), which bounds
what verification gains on text a proposer predicts perfectly, as a trained model's repetitive output nearly is.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_common import metadata, set_threads, stats, sync, write_json
from bench_offline_throughput import build_checkpoint

from vllm import LLM, SamplingParams


class OracleProposer:
    """Proposes the next K tokens of each request's known greedy continuation."""

    def __init__(self, prompts: list[dict], outputs, K: int) -> None:
        self.K = K
        self.prompt_len = len(prompts[0]["prompt_token_ids"])
        self.reference = {tuple(p["prompt_token_ids"]): o.outputs[0].token_ids for p, o in zip(prompts, outputs)}

    def propose(self, tokens) -> list[int]:
        done = len(tokens) - self.prompt_len
        return list(self.reference[tuple(tokens[:self.prompt_len].tolist())][done:done + self.K])


def make_llm(args, path: Path, graphs: bool, spec: dict | None, max_seqs: int, **extra) -> LLM:
    """The benchmarks' engine; `extra` adds LLM keywords or overrides these."""
    comp = {"cudagraph_mode": "FULL_DECODE_ONLY"} if graphs else None
    kwargs = dict(model=str(path), dtype=args.dtype, device=args.device, seed=args.seed, enforce_eager=not graphs,
                  compilation_config=comp, speculative_config=spec,
                  max_model_len=args.prompt_len + args.output_len + 16, max_num_seqs=max_seqs,
                  max_num_batched_tokens=max(2048, max_seqs * (1 + args.num_spec)),
                  gpu_memory_utilization=args.gpu_memory_utilization,
                  kv_cache_memory_bytes=(256 << 20) if args.device == "cpu" else None)
    return LLM(**{**kwargs, **extra})


def step_times(llm: LLM, batch: int, args) -> list[float]:
    """Seconds per decode step for `batch` requests, after their prefill."""
    engine = llm.llm_engine
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_steps + 2, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(3, engine.vocab_size, (args.prompt_len,), generator=gen).tolist()
        engine.add_request(f"b{batch}-{i}", {"prompt_token_ids": ids}, params)
    while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    times = []
    for _ in range(args.decode_steps):
        sync(args.device)
        t0 = time.perf_counter()
        engine.step()
        sync(args.device)
        times.append(time.perf_counter() - t0)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def repetitive_prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(n):
        phrase = torch.randint(3, vocab, (8,), generator=gen).tolist()
        prompts.append({"prompt_token_ids": (phrase * length)[:length]})
    return prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny", help="'tiny' or a KimiLinearConfig JSON file")
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--decode-steps", type=int, default=30)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-spec", type=int, default=3)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", default="steps,spec")
    ap.add_argument("--enforce-eager", action="store_true", help="part 2 without graphs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/gpu/spec_and_graphs.json")
    args = ap.parse_args()
    set_threads(args.threads)
    report = {"meta": metadata(args.device), "args": vars(args), "steps": [], "spec": []}
    path = Path(tempfile.mkdtemp(prefix="bench_spec_graphs_"))
    _, cfg = build_checkpoint(argparse.Namespace(config=args.config, device=args.device, dtype=args.dtype,
                                                 seed=args.seed), path)
    parts = args.parts.split(",")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    if "steps" in parts:
        engines = {"eager": make_llm(args, path, False, None, max(batches)),
                   "graphs": make_llm(args, path, True, None, max(batches))}
        for b in batches:
            row = {"batch_size": b}
            for name, llm in engines.items():
                row[name] = stats(step_times(llm, b, args)[3:])  # the first steps warm caches
            row["eager_over_graphs"] = row["eager"]["median"] / row["graphs"]["median"]
            report["steps"].append(row)
            write_json(args.out, report)
            print(f"batch {b:3}: eager {row['eager']['median'] * 1e3:7.2f} ms/step, graphs "
                  f"{row['graphs']['median'] * 1e3:7.2f} ms/step, x{row['eager_over_graphs']:.2f}", flush=True)
        del engines
    if "spec" in parts:
        spec = {"method": "ngram", "num_speculative_tokens": args.num_spec}
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        for c in (int(x) for x in args.concurrency.split(",")):
            prompts = repetitive_prompts(c, args.prompt_len, cfg["vocab_size"], args.seed + c)
            row = {"concurrency": c}
            outs = {}
            for name, s in (("plain", None), ("ngram", spec), ("oracle", spec)):
                llm = make_llm(args, path, not args.enforce_eager, s, max(c, 1))
                if name == "oracle":
                    llm.llm_engine.runner.drafting.ngram = OracleProposer(prompts, outs["plain"], args.num_spec)
                llm.generate(prompts, params, use_tqdm=False)  # warm-up
                times = []
                for _ in range(args.repeats):
                    sync(args.device)
                    t0 = time.perf_counter()
                    outs[name] = llm.generate(prompts, params, use_tqdm=False)
                    sync(args.device)
                    times.append(time.perf_counter() - t0)
                row[name] = {"seconds": stats(times),
                             "tokens_per_s": c * args.output_len / stats(times)["median"]}
                st = llm.llm_engine.spec_decode_stats
                if st is not None:
                    row[name].update(mean_acceptance_length=st.mean_acceptance_length,
                                     acceptance_rate=st.acceptance_rate, num_drafts=st.num_drafts,
                                     accepted_per_pos=st.num_accepted_tokens_per_pos)
                del llm
            plain = [o.outputs[0].token_ids for o in outs["plain"]]
            row["identical_outputs"] = all([o.outputs[0].token_ids for o in outs[n]] == plain
                                           for n in ("ngram", "oracle"))
            row["speedup"] = row["ngram"]["tokens_per_s"] / row["plain"]["tokens_per_s"]
            row["oracle_speedup"] = row["oracle"]["tokens_per_s"] / row["plain"]["tokens_per_s"]
            report["spec"].append(row)
            write_json(args.out, report)
            print(f"concurrency {c:3}: plain {row['plain']['tokens_per_s']:8.1f} tok/s, ngram "
                  f"{row['ngram']['tokens_per_s']:8.1f} tok/s (x{row['speedup']:.2f}, mean acceptance length "
                  f"{row['ngram']['mean_acceptance_length']:.2f}), oracle {row['oracle']['tokens_per_s']:8.1f} tok/s "
                  f"(x{row['oracle_speedup']:.2f}), identical: {row['identical_outputs']}",
                  flush=True)


if __name__ == "__main__":
    sys.exit(main())
