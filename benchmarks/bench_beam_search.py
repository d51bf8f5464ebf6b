"""Beam search's cost on the built-in model: wall time and engine prompt tokens of one search.

    python benchmarks/bench_beam_search.py --beam-width 10 --max-tokens 64

Every step runs each live beam as an engine request of its whole sequence (no prefix caching yet), so the
prompt tokens grow as width x max_tokens^2 / 2; what this measures beside them is the host work per step of
the search itself. A plain greedy request of the same length is timed for reference.

    python benchmarks/bench_beam_search.py --host-only --beam-width 10 --max-tokens 64,256,1024

`--host-only` times the search's own host work alone: `vllm.beam_search.beam_search` driven by a stand-in
engine that answers every beam at once with 2 x width made-up candidates (no model, no engine).
"""
from __future__ import annotations

import argparse
import random
import time

from vllm.beam_search import beam_search
from vllm.outputs import CompletionOutput, Logprob, RequestOutput
from vllm.sampling_params import BeamSearchParams


def host_only(width: int, max_tokens: int) -> tuple[float, int]:
    """Seconds of the search's own work, and the prompt tokens it would have sent."""
    rng = random.Random(0)
    rows = [{rng.randrange(1000, 50000): Logprob(-rng.random() * 5, r + 1) for r in range(2 * width)}
            for _ in range(64)]
    sent = [0]

    def fake_generate(batch, params):
        sent[0] += sum(len(p["prompt_token_ids"]) for p in batch)
        return [RequestOutput("r", None, p["prompt_token_ids"], None,
                              [CompletionOutput(0, "", [0], None, [rows[(j + len(p["prompt_token_ids"])) % 64]])],
                              True) for j, p in enumerate(batch)]

    start = time.perf_counter()
    beam_search(fake_generate, None, [[1, 2, 3, 4, 5, 6, 7, 8]],
                BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True), frozenset({2}))
    return time.perf_counter() - start, sent[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--beam-width", type=int, default=10)
    ap.add_argument("--max-tokens", default="64")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--host-only", action="store_true")
    args = ap.parse_args()
    if args.host_only:
        for n in map(int, args.max_tokens.split(",")):
            seconds, sent = host_only(args.beam_width, n)
            print(f"host only, beam_width={args.beam_width} max_tokens={n}: {seconds * 1e3:.1f} ms "
                  f"({sent} prompt tokens sent)")
        return
    from vllm import LLM, SamplingParams
    args.max_tokens = int(args.max_tokens)
    llm = LLM()
    prompt_tokens = [0]
    generate = llm.generate

    def counting(prompts, params=None, use_tqdm=True, **kw):
        prompt_tokens[0] += sum(len(p["prompt_token_ids"]) for p in prompts)
        return generate(prompts, params, use_tqdm=use_tqdm, **kw)

    llm.generate = counting
    llm.beam_search([args.prompt], BeamSearchParams(beam_width=2, max_tokens=2))  # warm-up
    prompt_tokens[0] = 0
    start = time.perf_counter()
    out = llm.beam_search([args.prompt], BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens,
                                                          ignore_eos=True))
    beam_s = time.perf_counter() - start
    start = time.perf_counter()
    generate([args.prompt], SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True), use_tqdm=False)
    plain_s = time.perf_counter() - start
    best = out[0].sequences[0]
    print(f"beam_width={args.beam_width} max_tokens={args.max_tokens}: beam search {beam_s:.2f} s, "
          f"{prompt_tokens[0]} engine prompt tokens, best beam {len(best.tokens)} tokens "
          f"(cum_logprob {best.cum_logprob:.3f}); plain greedy request {plain_s:.2f} s")


if __name__ == "__main__":
    main()
