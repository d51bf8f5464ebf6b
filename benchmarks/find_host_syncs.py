"""Where the engine's steps make the host wait for the GPU: every synchronizing CUDA call in served steps, by call
site, for one request generating greedily on the built-in model (CUDA only).

    python benchmarks/find_host_syncs.py --spec '{"method": "dspark", "num_speculative_tokens": 3}'

torch's sync debug mode warns at each operation that blocks the host on the device (a pageable copy, .item(),
nonzero, ...). A step is meant to have exactly one such wait, for its own outputs; any other stops the host from
queueing ahead of the device, and the host's work after it adds to the step's time instead of hiding under it.
Prints each call site's count per step and its innermost vllm frames.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import warnings

import torch

from vllm import LLM, SamplingParams
from vllm.assets import DEFAULT_DSPARK_DIR
from vllm.tools.prepare_corpus import heldout_code_windows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default=None, help="the --speculative-config JSON (none: no speculation)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--frames", type=int, default=4, help="vllm frames shown per call site")
    ap.add_argument("--max-steps", type=int, default=40)
    ap.add_argument("--async-scheduling", choices=("on", "off"), default=None)
    args = ap.parse_args()
    spec = json.loads(args.spec) if args.spec else None
    if spec is not None and spec["method"] == "dspark":
        spec.setdefault("model", str(DEFAULT_DSPARK_DIR))
    llm = LLM(device="cuda", max_model_len=1024, gpu_memory_utilization=0.3, speculative_config=spec,
              async_scheduling=None if args.async_scheduling is None else args.async_scheduling == "on")
    prompt = {"prompt_token_ids": heldout_code_windows(llm.get_tokenizer(), [64])[0]}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # first steps (compiles, caches) outside the count

    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames, f = [], sys._getframe(1)  # walking frames reads no source files, unlike traceback's helpers
        while f is not None and len(frames) < args.frames:
            if "/vllm/" in f.f_code.co_filename:
                frames.append(f"{f.f_code.co_filename.split('/vllm/')[-1]}:{f.f_lineno} {f.f_code.co_name}")
            f = f.f_back
        sites[tuple(frames)] += 1

    engine = llm.llm_engine
    steps = 0
    old = warnings.showwarning
    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        engine.add_request("sync-probe", prompt, params)
        while engine.has_unfinished_requests() and steps < args.max_steps:
            start = time.perf_counter()
            engine.step()
            steps += 1
            print(f"step {steps}: {sum(sites.values())} syncs so far, {time.perf_counter() - start:.4f} s")
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old
    print(f"{steps} steps, {sum(sites.values())} synchronizing calls ({sum(sites.values()) / steps:.2f} per step)")
    for frames, n in sites.most_common():
        print(f"{n / steps:6.2f} per step")
        for f in frames:
            print(f"         {f}")


if __name__ == "__main__":
    main()
