"""EngineCore: the engine as the server drives it, and the protocol of its process (core_proc.py runs it).

`EngineCore` wraps an LLMEngine with what serving needs around a step: bad input fails only its request, a step
that raises fails the requests in flight and the engine serves on, and counters for the metrics. The front end
(`AsyncLLM`) reaches it through a client (`core_client.py`): in its own process, stepping in a worker thread, or
in this module's process, which owns the GPU and steps as fast as the model runs, whatever the HTTP side costs
(in one process the event loop and the step share the GIL; upstream's reason for its engine core process).

The process protocol: one pipe each way per front end (several with `vllm serve --api-server-count N`, whose
API server processes share the core; core_router.py keeps which owns each request), one pickled tuple per
message.
- front end -> core: (ADD, request_id, prompt, params), (ABORT, request_id), (FINISH, [(child_id, kept tokens,
  status)]) for children the front end finished (a stop string), (CALL, call_id, method, args), (SHUTDOWN,);
- core -> front end: (READY, config, stats) or (FAILED, exception) once at start; then (OUTPUTS, records,
  rejected, stats) after each loop turn that changed something, (RESULT, call_id, value, error) for each CALL
  (an EngineCore method run between steps, e.g. reset_prefix_cache), and (STOPPED, records, rejected, stats)
  last, answering SHUTDOWN. The process exits once every front end has sent SHUTDOWN or gone away.
  `rejected` holds (request_id, exception) for requests that end with an error instead of an output. The
  process's engine builds no outputs: its records (`core_outputs.py`: new token ids, logprob rows, finish
  reasons) are what the front end turns into RequestOutputs (`frontend_outputs.py`), detokenizing there, so the
  core's step loop spends no time on text, logprob dicts or response objects.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import pickle
import time
from dataclasses import dataclass, field

from vllm.engine.llm_engine import LLMEngine
from vllm.inputs import PromptType
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.spec_decode.metrics import SpecDecodeStats

logger = logging.getLogger(__name__)

ADD, ABORT, FINISH, CALL, SHUTDOWN = "add", "abort", "finish", "call", "shutdown"
READY, FAILED, OUTPUTS, RESULT, STOPPED = "ready", "failed", "outputs", "result", "stopped"


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    state_slot_usage: float
    num_free_blocks: int
    num_blocks: int
    num_free_slots: int
    num_slots: int  # that requests can hold (the null slot, which marks "no state", is not one)
    prompt_tokens_total: int
    generation_tokens_total: int
    spec_decode: SpecDecodeStats | None = None  # engine-wide speculative-decoding counters
    num_preemptions_total: int = 0
    iteration_tokens: IterationTokens | None = None  # tokens per engine step, as a histogram
    # Prefix caching, in tokens since start: looked up and found by the scheduler (a preempted request's lookup
    # counts again), and found per request, counted once at its first token (upstream's prompt_tokens_cached).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens_cached: int = 0


# Upstream's buckets for vllm:iteration_tokens_total.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(slots=True)
class IterationTokens:
    """A histogram of tokens per step kept as plain counts, so that it crosses the process pipe as data."""
    counts: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1))  # the last: +Inf
    total: int = 0

    def observe(self, tokens: int) -> None:
        self.counts[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, tokens)] += 1
        self.total += tokens

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, count of steps with at most le tokens), Prometheus' bucket form."""
        edges = [str(float(b)) for b in ITERATION_TOKEN_BUCKETS] + ["+Inf"]
        return list(zip(edges, itertools.accumulate(self.counts)))


Rejected = list[tuple[str, Exception]]

# A served step past both bounds stalls every stream in flight visibly; the warning names the step's shape, so
# that a variant first met while serving (a compile, a new graph) can be found and warmed at start-up. Relative
# to the running mean too, so that a device whose every step is slow (a CPU) does not warn at each one.
SLOW_STEP_S = 0.1
SLOW_STEP_OVER_MEAN = 10.0


class EngineCore:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.prompt_tokens_total = 0
        self.iteration_tokens = IterationTokens()
        self._counted = None  # the engine's last step already counted
        self.mean_step_s: float | None = None  # exponential moving mean of step times

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> Exception | None:
        """Queues the request; bad input is returned (for that request's consumer), not raised."""
        try:
            self.prompt_tokens_total += self.engine.add_request(request_id, prompt, params)
        except Exception as e:  # noqa: BLE001 - bad input: only this request fails
            return e
        return None

    def abort(self, request_ids: str | list[str]) -> list[RequestOutput]:
        return self.engine.abort_request(request_ids)

    def abort_all(self) -> list[RequestOutput]:
        return self.engine.abort_request(list(self.engine.output_processor.parents))

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> tuple[list[RequestOutput], Rejected]:
        """One engine step. A step that raises is a bug, not bad input (the engine contains those per request):
        every request in flight fails with it, and the engine stays up for new ones."""
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001
            if getattr(e, "engine_dead", False):  # a tensor-parallel rank is gone: nothing can go on
                raise
            logger.exception("engine step failed")
            request_ids = list(self.engine.output_processor.parents)
            self.engine.abort_request(request_ids)
            error = RuntimeError(f"the engine failed while running this request: {e}")
            return [], [(rid, error) for rid in request_ids]
        seconds = time.perf_counter() - start
        if self.engine.last_scheduled is not self._counted:  # a step ran (one with nothing scheduled sets none)
            self._counted = self.engine.last_scheduled
            # Upstream's count: prompt tokens computed plus tokens generated, so a prompt's last chunk counts its
            # first output token as well (a decode row's fed-back token stands for the one it generates).
            self.iteration_tokens.observe(sum(s.num_tokens + (s.is_prefilling and s.samples)
                                              for s in self._counted.scheduled))
        mean = self.mean_step_s
        self.mean_step_s = seconds if mean is None else 0.95 * mean + 0.05 * seconds
        if (mean is not None and seconds >= max(SLOW_STEP_S, SLOW_STEP_OVER_MEAN * mean)
                and self.engine.last_scheduled is not None):
            rows = self.engine.last_scheduled.scheduled
            prefill = [s.num_tokens for s in rows if s.is_prefilling]
            logger.warning("engine step took %.3f s: %d rows, %d tokens, prefill chunks %s", seconds, len(rows),
                           sum(s.num_tokens for s in rows), prefill)
        return outputs, []

    def stats(self) -> EngineStats:
        engine = self.engine
        sched, kv = engine.scheduler, engine.kv_cache_manager
        blocks, slots = kv.usage
        return EngineStats(len(sched.running), len(sched.waiting), blocks, slots, kv.block_pool.num_free,
                           kv.block_pool.num_blocks, len(kv.free_slots), kv.num_state_slots - 1,
                           self.prompt_tokens_total, engine.output_processor.num_generation_tokens,
                           engine.spec_decode_stats, sched.num_preemptions_total,
                           dataclasses.replace(self.iteration_tokens, counts=list(self.iteration_tokens.counts)),
                           sched.prefix_cache_queries, sched.prefix_cache_hits,
                           engine.output_processor.num_prompt_tokens_cached)

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def call(self, method: str, args: tuple) -> tuple[object, Exception | None]:
        """A front end's call of one of these methods: (its value, None), or (None, what it raised), which
        fails that call alone."""
        try:
            return getattr(self, method)(*args), None
        except Exception as e:  # noqa: BLE001 - the caller's error, not the engine's
            return None, portable(e)


def portable(error: BaseException) -> Exception:
    """`error` if it survives pickling, else a RuntimeError with its text (an exception whose constructor takes
    other arguments than its message cannot be rebuilt on the other side)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(error).__name__}: {error}")
