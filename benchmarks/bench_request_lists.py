"""Per-step sampler cost of a batch in which one request carries a long per-request list.

    python benchmarks/bench_request_lists.py --batch 32 --vocab 163840 --entries 200000

One request of `--batch` has `allowed_token_ids` of `--entries` ids (clamped to the vocabulary: i % vocab)
and, in a second case, a `logit_bias` of `--bias-entries` ids; the others have none. Each step is what the
engine does for a batch whose membership changed (a new SamplingMetadata from the requests' params) followed
by the sampler on random logits; "reused" times the sampler alone on one metadata (the engine's steady decode,
where the metadata of an unchanged batch is reused). Times are the median (and the fastest) of `--steps` steps,
CPU; on a shared machine compare runs made back to back.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from vllm.sample.sampler import Sampler, SamplingMetadata
from vllm.sampling_params import SamplingParams


def median_ms(fn, steps: int) -> str:
    fn()  # warm-up (and whatever is built once per request)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return f"{statistics.median(times) * 1e3:8.2f} ({min(times) * 1e3:7.2f})"


def case(params: list[SamplingParams], logits: torch.Tensor, steps: int) -> tuple[str, str]:
    sampler = Sampler()
    n = len(params)

    def rebuilt():
        sampler(logits, SamplingMetadata.from_requests(params, [None] * n, [[] for _ in params], "cpu"))

    meta = SamplingMetadata.from_requests(params, [None] * n, [[] for _ in params], "cpu")
    return median_ms(rebuilt, steps), median_ms(lambda: sampler(logits, meta), steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--entries", type=int, default=200_000)
    ap.add_argument("--bias-entries", type=int, default=100_000)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    logits = torch.randn(args.batch, args.vocab)
    plain = SamplingParams(temperature=0.0)
    cases = {
        "no lists": [plain] * args.batch,
        f"1 x allowed_token_ids[{args.entries}]": [SamplingParams(
            temperature=0.0, allowed_token_ids=[i % args.vocab for i in range(args.entries)])] + [plain] * (
            args.batch - 1),
        f"1 x logit_bias[{args.bias_entries}]": [SamplingParams(
            temperature=0.0, logit_bias={i: 1.0 for i in range(args.bias_entries)})] + [plain] * (args.batch - 1),
    }
    print(f"batch {args.batch}, vocab {args.vocab}, median (fastest) of {args.steps} steps, ms:")
    for name, params in cases.items():
        rebuilt, reused = case(params, logits, args.steps)
        print(f"  {name:34s} metadata rebuilt + sample {rebuilt}   metadata reused, sample {reused}")


if __name__ == "__main__":
    main()
