"""What one step's outputs cost to cross the engine core's pipe: pickling them as RequestOutput dataclasses
against the tuples of vllm/engine/serial_utils.py, and unpickling (host only; no model).

    python benchmarks/bench_pipe_outputs.py --streams 64 --logprobs 1

A step's message holds one DELTA output per stream: a completion of one token, with `--logprobs` entries for
it. The core pickles on its step loop, the front end unpickles; medians of `--repeats` rounds of `--iters`.
"""
from __future__ import annotations

import argparse
import pickle
import statistics
import time

from bench_common import per_call_us

from vllm.engine.serial_utils import pack_outputs, unpack_outputs
from vllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def step_outputs(streams: int, logprobs: int) -> list[RequestOutput]:
    outs = []
    for i in range(streams):
        lps = [{100 + j: Logprob(-0.5 - j, j + 1, "ab") for j in range(logprobs)}] if logprobs else None
        c = CompletionOutput(0, "ab", [100], -1.0 if logprobs else None, lps)
        outs.append(RequestOutput(f"cmpl-{i}-0", None, [], None, [c], False, RequestMetrics(time.time())))
    return outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--logprobs", type=int, default=1, help="logprob entries per token (0: none)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    outs = step_outputs(args.streams, args.logprobs)
    proto = pickle.HIGHEST_PROTOCOL
    as_objects, as_tuples = pickle.dumps(outs, proto), pickle.dumps(pack_outputs(outs), proto)
    rows = [("dataclasses", lambda: pickle.dumps(outs, proto), lambda: pickle.loads(as_objects), len(as_objects)),
            ("tuples", lambda: pickle.dumps(pack_outputs(outs), proto),
             lambda: unpack_outputs(pickle.loads(as_tuples)), len(as_tuples))]
    print(f"{args.streams} streams, {args.logprobs} logprob entries per token:")
    for name, send, receive, size in rows:
        pickled, unpickled = (statistics.median(per_call_us(fn, args.iters, args.repeats)) for fn in (send, receive))
        print(f"  {name:<12} pickle {pickled:7.1f} us   unpickle {unpickled:7.1f} us   {size} bytes")


if __name__ == "__main__":
    main()
