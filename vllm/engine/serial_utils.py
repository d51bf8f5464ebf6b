"""RequestOutputs as plain tuples: how they crossed the engine core's pipe while the core built them. The pipe
now carries the core's records (core_outputs.py) and the front end builds the outputs; the benchmarks that
time the old layout (bench_core_closed_loop's `served` mode, bench_host_overhead, bench_gc_pauses,
bench_pipe_outputs) still pack with these.

Pickling slotted dataclasses goes through Python-level reduction per object: 64 streams' outputs of one step
(a completion each, its logprob) take 423-738 us to pickle and 310-601 us to unpickle on the development
machine, against 111-204 and 167-281 us as the tuples below, spelt out field by field (three runs of
benchmarks/bench_pipe_outputs.py --streams 64 --logprobs 1, a noisy machine; tuples built with a getattr per
field took 218 and 208 us). The core pickles on its step loop, so that time comes off every step.
Outputs travel without their prompt (text and ids): the front end has it and puts it back (`MPClient`).
The tuples spell the fields out in the dataclasses' order; tests/engine/test_serial_utils.py sets every field
of every dataclass to a non-default value and round-trips it, so a field added there and not here fails.
"""
from __future__ import annotations

from vllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def pack_outputs(outputs: list[RequestOutput]) -> list[tuple]:
    return [(o.request_id, o.prompt_logprobs, [_pack_completion(c) for c in o.outputs], o.finished,
             None if o.metrics is None else _pack_metrics(o.metrics), o.num_cached_tokens, o.extra, o.error)
            for o in outputs]


def unpack_outputs(packed: list[tuple]) -> list[RequestOutput]:
    """The outputs, with prompt None and prompt_token_ids [] for the receiver to fill in."""
    return [RequestOutput(rid, None, [], prompt_logprobs, [_unpack_completion(*c) for c in completions], finished,
                          None if metrics is None else RequestMetrics(*metrics), cached, extra, error)
            for rid, prompt_logprobs, completions, finished, metrics, cached, extra, error in packed]


def _pack_metrics(m: RequestMetrics) -> tuple:
    return (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time,
            m.num_preemptions, m.spec_num_drafts, m.spec_num_draft_tokens, m.spec_num_accepted_tokens,
            m.spec_num_accepted_tokens_per_pos)


def _pack_completion(c: CompletionOutput) -> tuple:
    logprobs = c.logprobs
    if logprobs is not None:
        logprobs = [{t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in pos.items()} for pos in logprobs]
    return c.index, c.text, c.token_ids, c.cumulative_logprob, logprobs, c.finish_reason, c.stop_reason


def _unpack_completion(index, text, token_ids, cumulative_logprob, logprobs, finish_reason, stop_reason
                       ) -> CompletionOutput:
    if logprobs is not None:
        logprobs = [{t: Logprob(*lp) for t, lp in pos.items()} for pos in logprobs]
    return CompletionOutput(index, text, token_ids, cumulative_logprob, logprobs, finish_reason, stop_reason)
