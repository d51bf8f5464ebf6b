"""RequestOutputs as plain tuples for the pipe between the engine core process and the front end.

Pickling slotted dataclasses goes through Python-level reduction per object: 64 streams' outputs of one step
(a completion each, its logprob) take 454 us to pickle and 413 us to unpickle on the development machine,
against 218 and 208 us as tuples (benchmarks/bench_pipe_outputs.py). The core pickles on its step loop, so that time came off every step. Outputs
travel without their prompt (text and ids): the front end has it and puts it back (`MPClient`). The field
order is the dataclasses' own; tests/engine/test_serial_utils.py round-trips every field, so a field added to
them and not here fails there.
"""
from __future__ import annotations

import dataclasses

from vllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

_METRICS = tuple(f.name for f in dataclasses.fields(RequestMetrics))
_COMPLETION = tuple(f.name for f in dataclasses.fields(CompletionOutput))
def pack_outputs(outputs: list[RequestOutput]) -> list[tuple]:
    return [(o.request_id, o.prompt_logprobs, [_pack_completion(c) for c in o.outputs], o.finished,
             None if o.metrics is None else tuple(getattr(o.metrics, f) for f in _METRICS), o.num_cached_tokens,
             o.extra, o.error) for o in outputs]


def unpack_outputs(packed: list[tuple]) -> list[RequestOutput]:
    """The outputs, with prompt None and prompt_token_ids [] for the receiver to fill in."""
    return [RequestOutput(rid, None, [], prompt_logprobs, [_unpack_completion(c) for c in completions], finished,
                          None if metrics is None else RequestMetrics(*metrics), cached, extra, error)
            for rid, prompt_logprobs, completions, finished, metrics, cached, extra, error in packed]


def _pack_completion(c: CompletionOutput) -> tuple:
    values = [getattr(c, f) for f in _COMPLETION]
    if c.logprobs is not None:
        values[4] = [{t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in pos.items()} for pos in c.logprobs]
    return tuple(values)


def _unpack_completion(values: tuple) -> CompletionOutput:
    c = CompletionOutput(*values)
    if c.logprobs is not None:
        c.logprobs = [{t: Logprob(*lp) for t, lp in pos.items()} for pos in c.logprobs]
    return c
