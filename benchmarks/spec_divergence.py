"""Where speculation's greedy output first differs from no speculation, and how close a call that token was.

    python benchmarks/spec_divergence.py --spec '{"method": "dspark", ...}' --concurrency 16 [--async-scheduling off]

Held-out code windows as in bench_spec_pareto.py, one closed batch. For each request whose tokens differ, prints
the first differing index and, from the run without speculation (logprobs=2), the gap between its top two
log-probabilities there: a gap near zero is a near-tie that a different summation order may flip (fp32 noise);
a large gap is a bug.
"""
from __future__ import annotations

import argparse
import json

from vllm import LLM, SamplingParams
from vllm.assets import DEFAULT_DSPARK_DIR
from vllm.tools.prepare_corpus import heldout_code_windows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True, help="--speculative-config JSON; model defaults to the shipped draft")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--async-scheduling", choices=["default", "on", "off"], default="default")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    spec = {"model": str(DEFAULT_DSPARK_DIR), **json.loads(args.spec)}
    common = dict(device=args.device, dtype="float32", max_model_len=1024, max_num_seqs=64,
                  gpu_memory_utilization=0.3)
    plain = LLM(**common)
    windows = heldout_code_windows(plain.get_tokenizer(), [args.prompt_len] * args.concurrency)
    prompts = [{"prompt_token_ids": w[:args.prompt_len]} for w in windows]
    ref = plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                                                 logprobs=2), use_tqdm=False)
    del plain
    mode = {"default": None, "on": True, "off": False}[args.async_scheduling]
    llm = LLM(**common, speculative_config=spec, async_scheduling=mode)
    got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True),
                       use_tqdm=False)
    differ = 0
    for i, (r, g) in enumerate(zip(ref, got)):
        want, have = r.outputs[0].token_ids, g.outputs[0].token_ids
        if want == have:
            continue
        differ += 1
        j = next(k for k in range(min(len(want), len(have))) if want[k] != have[k])
        top = sorted(r.outputs[0].logprobs[j].values(), key=lambda lp: -lp.logprob)
        gap = top[0].logprob - top[1].logprob if len(top) > 1 else float("nan")
        print(f"request {i}: first difference at token {j} (want {want[j]}, got {have[j]}); top-2 log-prob gap "
              f"there {gap:.3g}", flush=True)
    print(f"{differ} of {len(prompts)} requests differ (spec {spec}, async {llm.llm_engine.async_scheduling})")


if __name__ == "__main__":
    main()
