"""What Python's cyclic garbage collector costs a streaming engine step, with and without a frozen heap.

    python benchmarks/bench_gc_pauses.py --streams 64 --steps 200

One LLMEngine on the built-in model with its forward replaced by zeros (host work only), `--streams` requests
of 256 prompt tokens streaming DELTA outputs with the sampled token's logprob, as the engine core process runs
them under `vllm serve`; each timed step includes packing and pickling its outputs (the core's send). Rounds of
`--steps` steps alternate between the default collector and a heap frozen after start-up
(`vllm.utils.freeze_gc_heap`, what the core and API server processes do; `gc.unfreeze` between rounds). A
collection of the oldest generation walks every object the process holds and lands on whichever step
allocates at that moment, so it shows as the step's mean above its median.
"""
from __future__ import annotations

import argparse
import gc
import pickle
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import set_threads

from vllm.assets import DEFAULT_MODEL_DIR
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.llm_engine import LLMEngine
from vllm.engine.serial_utils import pack_outputs
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.utils import freeze_gc_heap


def timed_round(engine: LLMEngine, streams: int, steps: int, tag: str) -> list[float]:
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 40, ignore_eos=True, logprobs=0,
                            output_kind=RequestOutputKind.DELTA)
    ids = [f"{tag}-{i}" for i in range(streams)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(5, 500) for _ in range(256)], params)
    for _ in range(20):  # the prefill and the first decodes
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        pickle.dumps(pack_outputs(engine.step()))
        times.append((time.perf_counter() - t0) * 1e3)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2, help="rounds per mode, alternating")
    args = ap.parse_args()
    set_threads(1)
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(DEFAULT_MODEL_DIR), device="cpu",
                                                   max_num_seqs=args.streams, max_model_len=1024,
                                                   kv_cache_memory_bytes=1 << 30))
    hidden = engine.config.model_config.hf_config.hidden_size
    runner = engine.runner
    runner.model.forward = lambda ids, positions, meta: torch.zeros(ids.shape[0], hidden, dtype=runner.dtype)
    for r in range(args.rounds):
        for frozen in (False, True):
            if frozen:
                freeze_gc_heap()
            ms = timed_round(engine, args.streams, args.steps, f"r{r}{frozen}")
            if frozen:
                gc.unfreeze()
            print(f"{'frozen heap' if frozen else 'default gc':>12}: step median {statistics.median(ms):6.2f} ms, "
                  f"mean {statistics.fmean(ms):6.2f} ms, max {max(ms):7.2f} ms", flush=True)


if __name__ == "__main__":
    main()
