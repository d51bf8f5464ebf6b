"""Adaptive verification against fixed K, interleaved: both engines live in one process and take turns on the
same batches, so that drift of the machine over the run (clocks, other tenants) falls on both alike.

    python benchmarks/bench_adaptive_ab.py --configs dspark:3,adaptive:3 --concurrency 1,2,4,8,16,32,64 \
        --repeats 8 --out benchmarks/results/gpu/adaptive_ab.json

The Pareto sweep (bench_spec_pareto.py) runs one engine after another, and its per-user tok/s moved by 3-5%
between runs of the same config; adaptive's target, at least the best fixed K, is decided in that range. Here,
per concurrency, each repeat runs every config once on the same batches, in an order that alternates
(A B, then B A); per-user tok/s is 1000 / median TPOT over the repeat's requests, as in the sweep. The report
gives each config's median over repeats and, per repeat, the ratio of every config to the first, with its
median and range (paired: one repeat's configs ran back to back).

Where a difference comes from: per config, the engine's steps and its waits for the device are counted (the
runner's outputs record how long the host waited for each step). Wall time per step less the wait per step is
the host's own time per step; with the same steps, a config's extra host work shows there, and a wait near
zero says the host, not the device, sets the pace.
"""
from __future__ import annotations

import argparse
import collections
import sys

import numpy as np
from bench_common import metadata, stats, write_json
from bench_spec_builtin import timed_generate
from bench_spec_pareto import prompt_batches, spec_config, tpots

from vllm import LLM, SamplingParams
from vllm.assets import DEFAULT_DSPARK_DIR
from vllm.tools.prepare_corpus import heldout_code_windows


class StepCounter:
    """Counts an engine's steps and the host's waits for them, by wrapping its runner's execute_model (this
    engine's only). A step's wait is known once the engine has drained it, which under async scheduling is
    after the next launch: it is taken two launches later, and the rest by `flush` at the end of a run."""

    def __init__(self, llm: LLM) -> None:
        self.steps, self.waited = 0, 0.0
        self._in_flight: collections.deque = collections.deque()
        runner = llm.llm_engine.runner
        execute = runner.execute_model

        def counted(*args, **kwargs):
            launched = execute(*args, **kwargs)
            self.steps += 1
            self._in_flight.append(launched)
            if len(self._in_flight) > 2:
                self.waited += self._in_flight.popleft().waited
            return launched

        runner.execute_model = counted

    def flush(self) -> tuple[int, float]:
        """(steps, seconds waited) since the last flush."""
        while self._in_flight:
            self.waited += self._in_flight.popleft().waited
        taken = (self.steps, self.waited)
        self.steps, self.waited = 0, 0.0
        return taken


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--configs", default="dspark:3,adaptive:3",
                    help="the first is the reference of the ratios; NAME#TAG runs another engine of NAME (an A/A "
                         "control: dspark:3,adaptive:3,dspark:3#2 shows the pairing's own spread)")
    ap.add_argument("--draft", default=str(DEFAULT_DSPARK_DIR))
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--min-requests", type=int, default=8, help="windows per concurrency at least (batches of c)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    # Each engine's cache pools, given: the device's share would count the other engine's memory as its own.
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=4 << 30)
    ap.add_argument("--out", default="benchmarks/results/gpu/adaptive_ab.json")
    args = ap.parse_args(argv)
    names = args.configs.split(",")
    engines = {name: LLM(device=args.device, dtype=args.dtype, max_model_len=1024, max_num_seqs=args.max_num_seqs,
                         kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                         speculative_config=spec_config(name.split("#")[0], args.draft)) for name in names}
    counters = {name: StepCounter(llm) for name, llm in engines.items()}
    concurrencies = [int(x) for x in args.concurrency.split(",")]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    num_windows = max(max(concurrencies), args.min_requests)
    # The sweep's windows (it keeps 4 tokens after each prompt as the answer).
    windows = heldout_code_windows(engines[names[0]].get_tokenizer(), [args.prompt_len + 4] * num_windows)
    rows = []
    for c in concurrencies:
        batches = prompt_batches(windows, c, args.min_requests, args.prompt_len)
        for name, llm in engines.items():
            timed_generate(llm, batches[0], params, args.device)  # warm-up
            counters[name].flush()
        per_user = {name: [] for name in names}
        step_ms, wait_ms = ({name: [] for name in names} for _ in range(2))
        ids = {}
        for r in range(args.repeats):
            for name in (names if r % 2 == 0 else names[::-1]):
                outs, wall = [], 0.0
                for batch in batches:
                    seconds, batch_outs = timed_generate(engines[name], batch, params, args.device)
                    outs, wall = outs + batch_outs, wall + seconds
                per_user[name].append(1.0 / float(np.median(tpots(outs))))
                ids[name] = [o.outputs[0].token_ids for o in outs]
                steps, waited = counters[name].flush()
                step_ms[name].append(1e3 * wall / steps)
                wait_ms[name].append(1e3 * waited / steps)
        ref = names[0]
        row = {"concurrency": c, "per_user_tok_s": {name: stats(v) for name, v in per_user.items()},
               "ms_per_step": {name: stats(v) for name, v in step_ms.items()},
               "device_wait_ms_per_step": {name: stats(v) for name, v in wait_ms.items()},
               "host_ms_per_step": {name: stats(list(np.subtract(step_ms[name], wait_ms[name]))) for name in names},
               "ratio_to_" + ref: {name: stats(list(np.divide(per_user[name], per_user[ref])))
                                   for name in names[1:]},
               "identical_to_" + ref: {name: ids[name] == ids[ref] for name in names[1:]}}
        for name, llm in engines.items():
            verifier = llm.llm_engine.runner.adaptive_verifier
            if verifier is not None:  # cumulative over the engine's life
                row[f"{name}_drafts_kept"] = verifier.num_kept / max(verifier.num_offered, 1)
                row[f"{name}_calibration_scale"] = verifier.calibration.scale.tolist()
        rows.append(row)
        print(c, {name: round(row["per_user_tok_s"][name]["median"]) for name in names},
              {name: round(v["median"], 3) for name, v in row["ratio_to_" + ref].items()},
              "range", {name: (round(float(min(np.divide(per_user[name], per_user[ref]))), 3),
                               round(float(max(np.divide(per_user[name], per_user[ref]))), 3)) for name in names[1:]},
              "ms per step (host + wait)", {name: (round(row["host_ms_per_step"][name]["median"], 3),
                                                   round(row["device_wait_ms_per_step"][name]["median"], 3))
                                            for name in names},
              flush=True)
        write_json(args.out, {"meta": metadata(args.device), "argv": sys.argv, "rows": rows})


if __name__ == "__main__":
    main()
