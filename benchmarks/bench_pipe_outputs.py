"""What one step's outputs cost to cross the engine core's pipe (host only; no model): the records the core sends
since the front end builds the outputs (vllm/engine/core_outputs.py: one plain tuple per child) against the same
step as columns (numpy arrays of the token ids and logprob rows, the ids of the children beside them: issue 51's
"arrays, not pickled objects"), and the older layouts that sent RequestOutputs (as dataclasses, and as the
tuples of vllm/engine/serial_utils.py).

    python benchmarks/bench_pipe_outputs.py --streams 64 --logprobs 1

A step's message holds one token per stream, with `--logprobs` entries for it. The core packs and pickles on its
step loop, the front end unpickles (and, for columns, turns them back into per-child rows, as it reads them);
medians of `--repeats` rounds of `--iters`.
"""
from __future__ import annotations

import argparse
import pickle
import statistics
import time

import numpy as np
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


def core_records(streams: int, logprobs: int) -> list[tuple]:
    row = lambda i: ([100 + i] * (logprobs + 1), [-0.5] * (logprobs + 1), 1) if logprobs else None  # noqa: E731
    return [(f"cmpl-{i:032x}-0", [100 + i], row(i), None, None, None, 0, 12345.6 + i, 0, None, None)
            for i in range(streams)]


def to_columns(records: list[tuple], logprobs: int) -> tuple:
    ids = [r[0] for r in records]
    tokens = np.fromiter((r[1][0] for r in records), np.int64, len(records))
    if not logprobs:
        return ids, tokens
    return (ids, tokens, np.array([r[2][0] for r in records], np.int64),
            np.array([r[2][1] for r in records], np.float32), np.array([r[2][2] for r in records], np.int64))


def from_columns(cols: tuple) -> list[tuple]:
    ids, tokens = cols[0], cols[1].tolist()
    if len(cols) == 2:
        return [(i, [t]) for i, t in zip(ids, tokens)]
    lp_ids, lps, ranks = cols[2].tolist(), cols[3].tolist(), cols[4].tolist()
    return [(i, [t], (a, b, k)) for i, t, a, b, k in zip(ids, tokens, lp_ids, lps, ranks)]


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
    records = core_records(args.streams, args.logprobs)
    as_records, as_columns = pickle.dumps(records, proto), pickle.dumps(to_columns(records, args.logprobs), proto)
    rows = [("core records", lambda: pickle.dumps(records, proto), lambda: pickle.loads(as_records), len(as_records)),
            ("core columns", lambda: pickle.dumps(to_columns(records, args.logprobs), proto),
             lambda: from_columns(pickle.loads(as_columns)), len(as_columns)),
            ("dataclasses", lambda: pickle.dumps(outs, proto), lambda: pickle.loads(as_objects), len(as_objects)),
            ("tuples", lambda: pickle.dumps(pack_outputs(outs), proto),
             lambda: unpack_outputs(pickle.loads(as_tuples)), len(as_tuples))]
    print(f"{args.streams} streams, {args.logprobs} logprob entries per token:")
    for name, send, receive, size in rows:
        pickled, unpickled = (statistics.median(per_call_us(fn, args.iters, args.repeats)) for fn in (send, receive))
        print(f"  {name:<12} pickle {pickled:7.1f} us   unpickle {unpickled:7.1f} us   {size} bytes")


if __name__ == "__main__":
    main()
