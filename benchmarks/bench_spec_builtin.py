"""Speculation on the built-in trained model (ngram, or a DSpark draft): output tokens/s with and without drafts,
acceptance length per position.

    python benchmarks/bench_spec_builtin.py --device cuda --out benchmarks/results/gpu/spec_builtin.json
    python benchmarks/bench_spec_builtin.py --method dspark --draft vllm/assets/default_model_dspark

Code prompts (the model was trained on Python's standard library), greedy, at each `--concurrency` (that many
requests in one generate call, each prompt repeated as needed), with CUDA graphs unless --enforce-eager. Per
(concurrency, K): the median over `--repeats` of the whole generate call's output tokens/s, the speed-up against
no speculation measured in the same run, the mean acceptance length (1 + accepted / verifies) and whether the
outputs are identical to the plain run's (speculation is lossless under greedy).
"""
from __future__ import annotations

import argparse
import sys
import time

from bench_common import metadata, stats, sync, write_json

from vllm import LLM, SamplingParams

CODE_PROMPTS = ["import os\n\n\ndef ", "class Stack:\n    def __init__(self):\n", "def fibonacci(n):\n",
                "# Copyright", "    def __repr__(self):\n        return ", "from test import support\n",
                "import unittest\n\n\nclass Test", "def main():\n    parser = argparse.ArgumentParser("]


def timed_generate(llm: LLM, prompts: list[str], params: SamplingParams, device: str) -> tuple[float, list]:
    sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync(device)
    return time.perf_counter() - t0, outs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--num-spec", default="1,3,5", help="K values to compare against no speculation")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--method", default="ngram", choices=["ngram", "dspark"])
    ap.add_argument("--draft", help="the DSpark draft checkpoint (--method dspark)")
    ap.add_argument("--out", default="benchmarks/results/gpu/spec_builtin.json")
    args = ap.parse_args(argv)
    extra = {"model": args.draft} if args.method == "dspark" else {}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    Ks = [None] + [int(k) for k in args.num_spec.split(",")]
    engines = {K: LLM(device=args.device, dtype=args.dtype, enforce_eager=args.enforce_eager, max_model_len=1024,
                      speculative_config=None if K is None else {"method": args.method, "num_speculative_tokens": K,
                                                                                 **extra})
               for K in Ks}
    rows = []
    for c in (int(x) for x in args.concurrency.split(",")):
        prompts = [CODE_PROMPTS[i % len(CODE_PROMPTS)] for i in range(c)]
        plain = None
        for K, llm in engines.items():
            timed_generate(llm, prompts, params, args.device)  # warm-up: graphs, kernels
            times, outs = [], None
            for _ in range(args.repeats):
                dt, outs = timed_generate(llm, prompts, params, args.device)
                times.append(dt)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            drafts = sum(o.metrics.spec_num_drafts for o in outs)
            accepted = sum(o.metrics.spec_num_accepted_tokens for o in outs)
            ids = [o.outputs[0].token_ids for o in outs]
            summary = stats(times)
            median = summary["median"]
            if K is None:
                plain = (ids, median)
            rows.append({"concurrency": c, "method": args.method if K else None, "num_spec": K,
                         "output_tokens": tokens, "time_s": summary,
                         "tok_per_s": tokens / median, "speedup_vs_no_spec": plain[1] / median,
                         "mean_acceptance_length": (1 + accepted / drafts) if drafts else None,
                         "acceptance_rate_per_pos": [sum(col) / drafts for col in zip(
                             *(o.metrics.spec_num_accepted_tokens_per_pos for o in outs))] if drafts else None,
                         "identical_to_no_spec": ids == plain[0]})
            print(rows[-1], flush=True)
    write_json(args.out, {"meta": metadata(args.device), "argv": sys.argv, "rows": rows})


if __name__ == "__main__":
    main()
