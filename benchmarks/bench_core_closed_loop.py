"""The engine core alone under bench_serve_sweep.py's load, without HTTP: what separates the served figure from
the offline one.

    python benchmarks/bench_core_closed_loop.py --device cuda --config benchmarks/configs/kimi-linear-1b3.json \
        --dtype bfloat16 --concurrency 64 --input-len 256 --output-len 128 \
        --out benchmarks/results/gpu/core_closed_loop.json

The same checkpoint as the other benchmarks (same --config and --seed), one LLMEngine built as `vllm serve`
builds it for the sweep (--max-num-seqs = concurrency, --max-model-len = input + output + 8), and the sweep's
load: 4 x concurrency requests of random prompt ids, greedy, exactly --output-len tokens, streamed (DELTA
outputs with the sampled token's logprob), at most `concurrency` in flight and a new one added as soon as one
finishes (a closed loop). Each step's outputs are packed and pickled as the engine core process sends them,
with the heap frozen as it is there. Every step is recorded: its scheduled tokens, decode and prefill rows, and
host time. `--mode offline` instead adds all requests at once with FINAL_ONLY outputs, as the offline benchmark
runs them: the same loop, so the two modes' throughputs compare directly. `--mode served_core` is the served
load as the engine core process runs it since the front end builds the outputs: the core's step returns records
(token ids, logprob rows; vllm/engine/core_outputs.py) and only those are pickled; the detokenization and the
RequestOutputs of `served` are the front end's work there.

Against bench_serve_sweep.py at the same concurrency: a core that reaches the served figure alone is the
bottleneck (its step mix or its output processing); one well above it leaves the gap to the front end and the
client (the sweep's CPU-utilization column says which).
"""
from __future__ import annotations

import argparse
import pickle
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import metadata, stats, sync, write_json
from bench_offline_throughput import add_checkpoint_args, build_checkpoint

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.llm_engine import LLMEngine
from vllm.engine.serial_utils import pack_outputs
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.utils import freeze_gc_heap


def run(engine: LLMEngine, args, vocab: int) -> dict:
    rng = random.Random(args.seed)
    served = args.mode in ("served", "served_core")
    records = args.mode == "served_core"
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                            logprobs=0 if served else None,
                            output_kind=RequestOutputKind.DELTA if served else RequestOutputKind.FINAL_ONLY)
    total = 4 * args.concurrency
    prompts = [[rng.randrange(5, vocab) for _ in range(args.input_len)] for _ in range(total)]
    in_flight = 0
    next_id = 0

    def top_up() -> None:
        nonlocal in_flight, next_id
        while next_id < total and in_flight < args.concurrency:
            engine.add_request(f"r{next_id}", prompts[next_id], params)
            next_id += 1
            in_flight += 1

    scheduled = []
    schedule = engine.scheduler.schedule

    def recorded_schedule(*a, **k):  # the step each engine.step() call queues
        out = schedule(*a, **k)
        scheduled.append(out)
        return out
    engine.scheduler.schedule = recorded_schedule  # instance attribute: shadows the method, removed below
    process = engine.output_processor.process
    output_s = [0.0]

    def timed_process(*a, **k):  # the engine's output side of each step: what moved to the front end
        t = time.perf_counter()
        out = process(*a, **k)
        output_s[0] += time.perf_counter() - t
        return out
    engine.output_processor.process = timed_process
    steps = []
    tokens_out = 0
    sync(args.device)
    t_start = time.perf_counter()
    top_up()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        output_s[0] = 0.0
        outputs = engine.step()
        t_pickle = time.perf_counter()
        blob = pickle.dumps(outputs if records else pack_outputs(outputs)) if served else b""
        t1 = time.perf_counter()
        pickle_s = time.perf_counter() - t_pickle
        sched = scheduled[-1].scheduled if scheduled else []
        scheduled.clear()
        rows = Counter("prefill" if s.is_prefilling else "decode" for s in sched)
        tokens = sum(s.num_tokens for s in sched)
        steps.append({"ms": round((t1 - t0) * 1e3, 3), "output_ms": round((output_s[0] + pickle_s) * 1e3, 4),
                      "tokens": tokens, "decode_rows": rows["decode"],
                      "prefill_rows": rows["prefill"], "bytes": len(blob)})
        for out in outputs:
            if records:  # (child_id, new_token_ids, ..., finish, ...): n = 1 and no stop strings here
                tokens_out += len(out[1])
                in_flight -= out[4] is not None
                continue
            tokens_out += sum(len(c.token_ids) for c in out.outputs)
            if out.finished:
                in_flight -= 1
        top_up()
    sync(args.device)
    wall = time.perf_counter() - t_start
    del engine.scheduler.schedule
    del engine.output_processor.process
    ms = [s["ms"] for s in steps]
    mixed = [s for s in steps if s["prefill_rows"]]
    return {"mode": args.mode, "requests": total, "output_tokens": tokens_out, "wall_s": wall,
            "output_tokens_per_s": tokens_out / wall, "num_steps": len(steps), "step_ms": stats(ms),
            "decode_only_step_ms": stats([s["ms"] for s in steps if not s["prefill_rows"]] or [0.0]),
            # the step's output processing (OutputProcessor or the core's records) plus the pickle of its message
            "decode_only_output_ms": stats([s["output_ms"] for s in steps if not s["prefill_rows"]] or [0.0]),
            "mixed_steps": len(mixed), "mixed_step_ms": stats([s["ms"] for s in mixed] or [0.0]),
            "mixed_step_tokens": stats([s["tokens"] for s in mixed] or [0]),
            "time_in_mixed_steps_s": sum(s["ms"] for s in mixed) / 1e3, "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_args(ap)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--modes", default="served,served_core,offline",
                    help="comma list of served, served_core, offline")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the engine's")
    ap.add_argument("--out", default="benchmarks/results/cpu/core_closed_loop_cpu.json")
    args = ap.parse_args()
    meta = metadata(args.device)
    tmp = Path(tempfile.mkdtemp(prefix="bench_core_closed_loop_"))
    hf, cfg = build_checkpoint(args, tmp)
    del hf
    if args.device == "cuda":
        torch.cuda.empty_cache()
    extra = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}
    # Prefix caching off: the timed run repeats the warm-up's prompts, which would skip their prefill from the
    # cache (the sweep's prompts never repeat).
    engine_args = EngineArgs(
        model=str(tmp), device=args.device, dtype=args.dtype, seed=args.seed, max_num_seqs=args.concurrency,
        max_model_len=args.input_len + args.output_len + 8, enable_prefix_caching=False, **extra)
    modes = args.modes.split(",")
    engines = {records: LLMEngine.from_engine_args(engine_args, front_end_outputs=records)
               for records in sorted({m == "served_core" for m in modes})}
    freeze_gc_heap()  # as the engine core process does once the engine is built
    results = []
    for mode in modes:
        args.mode = mode
        engine = engines[mode == "served_core"]
        run(engine, args, cfg["vocab_size"])  # warm-up: first-time costs (JIT, allocator growth)
        r = run(engine, args, cfg["vocab_size"])
        results.append(r)
        print(f"{mode:>8}: {r['output_tokens_per_s']:9.1f} output tok/s, {r['num_steps']} steps, step median "
              f"{r['step_ms']['median']:.2f} ms (decode-only {r['decode_only_step_ms']['median']:.2f}, of which "
              f"outputs + pickle {r['decode_only_output_ms']['median']:.3f}), "
              f"{r['mixed_steps']} mixed steps of median {r['mixed_step_tokens']['median']:.0f} tokens taking "
              f"{r['mixed_step_ms']['median']:.2f} ms, {r['time_in_mixed_steps_s']:.2f} of {r['wall_s']:.2f} s",
              flush=True)
    path = write_json(args.out, {**meta, "benchmark": "core_closed_loop", "config": {**vars(args),
                                                                                     "model_config": cfg},
                                 "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
