"""Front-end CPU per streamed output in the server's request generator (`OpenAIServing.generate`), without HTTP or
an engine: a stub engine hands each request its outputs as the real client does (one collector wake-up each),
and `--streams` requests are consumed together, as a step's outputs are by their handlers.

    python benchmarks/bench_serving_generate.py --streams 64 --tokens 128

Prints microseconds of the event loop's time per output, the median of `--repeats` runs.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from types import SimpleNamespace

from vllm.entrypoints.openai.serving_engine import OpenAIServing, ServerSettings
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams


class StubEngine:
    """What OpenAIServing reads of AsyncLLM: `generate` yields `tokens` one-token deltas, each after a wake-up
    of its own (as a collector's `get` is woken by the output loop)."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.config = SimpleNamespace(model_config=SimpleNamespace(get_diff_sampling_param=dict))
        self.tokenizer = SimpleNamespace(all_special_ids=[0, 1, 2])

    async def generate(self, prompt, params, request_id):
        for t in range(self.tokens):
            await asyncio.sleep(0)
            last = t == self.tokens - 1
            yield RequestOutput(request_id, None, [1, 2, 3], None,
                                [CompletionOutput(0, "x", [t], None, None, "length" if last else None)], last)


async def run(streams: int, tokens: int) -> float:
    engine = StubEngine(tokens)
    metrics = SimpleNamespace(timer=lambda: SimpleNamespace(update=lambda n: None, finish=lambda *a: None))
    serving = OpenAIServing(engine, ServerSettings(["m"], log_requests=False), metrics)
    params = SamplingParams(max_tokens=tokens, output_kind=RequestOutputKind.DELTA)

    async def consume(i: int) -> int:
        n = 0
        async for _ in serving.generate([[1, 2, 3]], params, f"r{i}"):
            n += 1
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(consume(i) for i in range(streams)))
    assert sum(counts) == streams * tokens, counts
    return (time.perf_counter() - t0) / (streams * tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    runs = [asyncio.run(run(args.streams, args.tokens)) for _ in range(args.repeats)]
    print(f"{statistics.median(runs) * 1e6:.2f} us per output (median of {args.repeats}; "
          f"{args.streams} streams x {args.tokens} outputs)")


if __name__ == "__main__":
    main()
