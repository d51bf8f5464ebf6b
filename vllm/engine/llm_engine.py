"""LLMEngine: add_request / abort_request / step, owning the scheduler, the model runner and the outputs.

Admission (tokenizing, checks, n > 1 as n child requests) is engine/input_processor.py; the output processor
folds the children back into one RequestOutput.
"""
from __future__ import annotations

import dataclasses
import logging
import time

from vllm.config import VllmConfig
from vllm.core.request import Request, RequestStatus
from vllm.core.scheduler import Scheduler, SchedulerOutput
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.core_outputs import CoreOutputCollector
from vllm.engine.input_processor import InputProcessor
from vllm.engine.output_processor import OutputProcessor
from vllm.inputs import PromptType
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.spec_decode.metrics import SpecDecodeStats
from vllm.structured_output.manager import StructuredOutputManager
from vllm.transformers_utils.tokenizer import check_vocab, get_tokenizer
from vllm.worker.model_runner import ModelRunner
from vllm.worker.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

logger = logging.getLogger(__name__)

# How many failed steps a request may be part of before it is failed itself (see LLMEngine._contain).
MAX_FAILED_STEPS = 3
# The longest an idle step waits for a grammar's compile (it returns as soon as one is done).
COMPILE_WAIT_S = 0.01


class LLMEngine:
    def __init__(self, config: VllmConfig, front_end_outputs: bool = False) -> None:
        """front_end_outputs: step() returns core records (core_outputs.py) for a front end in another process
        to turn into RequestOutputs (frontend_outputs.py), instead of building them here."""
        self.config = config
        mc = config.model_config
        self.tokenizer = get_tokenizer(mc.tokenizer, trust_remote_code=mc.trust_remote_code)
        check_vocab(self.tokenizer, mc.tokenizer, mc.hf_config.vocab_size)  # before the (slow) model load
        self.runner = ModelRunner(config)
        self.kv_cache_manager = self.runner.initialize_cache()
        self.num_spec = config.num_speculative_tokens
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager, self.num_spec,
                                   config.cache_config.kda_snapshot_interval)
        self.output_processor = CoreOutputCollector() if front_end_outputs else OutputProcessor(self.tokenizer)
        self.eos_token_ids = mc.eos_token_ids(self.tokenizer.eos_token_id)
        self.vocab_size = mc.hf_config.vocab_size
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, self.eos_token_ids, mc.max_model_len,
                                              mc.device, self.num_spec)
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                                  config.scheduler_config.max_num_seqs, mc.device)
        # Async scheduling: the step queued on the device whose outputs are not processed yet.
        self.async_scheduling = config.scheduler_config.async_scheduling
        self.in_flight: tuple[SchedulerOutput, AsyncModelRunnerOutput] | None = None
        self.last_scheduled: SchedulerOutput | None = None  # the latest step launched: what a slow step ran
        self.last_launched: AsyncModelRunnerOutput | None = None  # its device outputs, which the next step reads
        self.history_bans: list[Request] = []  # unfinished requests with bad words of several tokens
        # Adaptive verification's step periods (runner.record_step_period): when the last step started, if every
        # row of it verified drafts; how long it waited for the device; and (requests, tokens, re-cut) of the
        # all-verify step it waited for, if it waited for one.
        self._verify_step_start: float | None = None
        self._waited = 0.0
        self._drained_shape: tuple[int, int, bool] | None = None
        logger.info("async scheduling %s", "on" if self.async_scheduling else "off")

    @classmethod
    def from_engine_args(cls, args: EngineArgs, front_end_outputs: bool = False) -> LLMEngine:
        config = args.create_engine_config()
        if config.parallel_config.tensor_parallel_size > 1:
            from vllm.executor.tp_engine import TPEngine  # it builds on this class
            return TPEngine(config, front_end_outputs)
        return cls(config, front_end_outputs)

    # ---- requests ---------------------------------------------------------------------------------------------
    def process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return self.input_processor.process_prompt(prompt)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None) -> int:
        """Queues the request (n children for n > 1); returns its number of prompt tokens."""
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids, params, children = self.input_processor.process(request_id, prompt, params, arrival_time)
        clash = next((c.request_id for c in children if c.request_id in self.scheduler.requests), None)
        if clash is not None:  # "a" with n=2 has children "a-0" and "a-1": a request "a-1" must not become one
            raise ValueError(f"request_id {request_id!r} cannot be used now: its sample id {clash!r} is another "
                             "request's id")
        self.output_processor.add(request_id, text, children, params)
        for c in children:
            if params.structured_outputs is not None:
                self.structured.add(c, params.structured_outputs)
            self.scheduler.add_request(c)
        if any(len(seq) > 1 for seq in params.bad_words_token_ids):
            self.history_bans += children
        return len(ids)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        outputs = []
        for rid in ids:
            self.scheduler.abort(self.output_processor.child_ids(rid))
            outputs += self.output_processor.abort(rid)
        self.runner.remove_finished(self.scheduler.requests)
        return outputs

    def finish_children(self, finished: list[tuple[str, int, str]]) -> None:
        """Children the front end finished (front_end_outputs: a stop string, or their output failed there):
        (child_id, tokens it kept, RequestStatus value). Freed now; tokens computed meanwhile are dropped."""
        for child_id, kept, status in finished:
            if self.output_processor.finished_by_front_end(child_id, kept):
                req = self.scheduler.requests.get(child_id)
                if req is not None:
                    self.scheduler.finish(req, RequestStatus(status))
        self.runner.remove_finished(self.scheduler.requests)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (blocks and snapshots not held by a request); True once done, as
        upstream's LLM.reset_prefix_cache()."""
        return self.kv_cache_manager.reset_prefix_cache()

    @property
    def model_config(self):
        """Upstream's `llm.llm_engine.model_config` (max_model_len, dtype, ...)."""
        return self.config.model_config

    def has_unfinished_requests(self) -> bool:
        """Requests left, or a step in flight whose outputs are not processed yet."""
        return self.scheduler.num_unfinished > 0 or self.in_flight is not None

    # ---- stepping ---------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and queues one step. Synchronously, returns its outputs. With async scheduling, returns the
        outputs of the step before, processed while this one runs on the device; its tokens reach the host one
        step late, so a request that stops has one more token computed and dropped."""
        start = time.perf_counter()
        if self._verify_step_start is not None:
            # The loop's period from the last all-verify step to this one: less its waits for the device, the
            # host's work per step, including what the caller does between steps (the engine core process packs
            # and sends each step's outputs); whole, the cost of the step it waited for. Only timed when that
            # step left work, so no idle time falls in it.
            self.runner.record_step_period(start - self._verify_step_start, self._waited, self._drained_shape)
        self._verify_step_start, self._waited, self._drained_shape = None, 0.0, None
        outputs = []
        if self.in_flight is not None and (self.scheduler.suspect is not None or self._needs_history()):
            outputs = self._drain()  # a suspect runs alone, and a history-dependent ban needs the latest token
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            outputs += self._drain()
            if not outputs and self.scheduler.waiting:  # what waits is a grammar still compiling: wait on it
                self.structured.wait_for_compiles(COMPILE_WAIT_S)
            return outputs
        rows = sched.scheduled
        self.last_scheduled = sched
        early: list[RequestOutput] = []  # the step before's, when the grammar hook drained it
        try:
            launched = self.runner.execute_model(sched, self.kv_cache_manager, self.last_launched,
                                                 last_landed=self.in_flight is None,
                                                 before_sampling=self._grammar_hook(sched, early))
        except Exception as e:  # noqa: BLE001 - contained: only the request that causes it fails
            outputs += early + self._drain()
            return outputs + self._contain(sched, e)
        self.last_launched = launched
        outputs += early + self._drain()
        self.in_flight = (sched, launched)
        if not self.async_scheduling:
            outputs += self._drain()
        self.runner.propose_drafts(self.scheduler.running, launched)
        # Every row verified drafts (the steps adaptive verification plans): timed up to the next step.
        if len(launched.verify_rows) == len(rows) and self.has_unfinished_requests():
            self._verify_step_start = start
        return outputs

    def _needs_history(self) -> bool:
        """A request bans tokens by what its output ends with (a bad word of several tokens), so its next step
        needs the step in flight's token on the host first. Only those requests are looked at, not every
        running one at every step."""
        if self.history_bans:
            self.history_bans = [r for r in self.history_bans if not r.status.finished]
        return bool(self.history_bans)

    def _grammar_hook(self, sched: SchedulerOutput, early: list[RequestOutput]):
        """For a step with structured-output rows: what the runner calls once the forward is queued. It drains
        the step before (its tokens advance the matchers, in _process_step) into `early`, then returns the
        rows' bitmask; the host does this while the device runs the forward."""
        if not self.structured.any_live():
            return None
        rows = [s.request for s in sched.scheduled if s.samples and not s.draft_token_ids]
        if not any(r.structured_output is not None for r in rows):
            return None

        def before_sampling():
            early.extend(self._drain())
            mask, failed = self.structured.grammar_bitmask(rows)
            early.extend(self._fail(failed))
            return mask
        return before_sampling

    def _fail(self, failed: list[tuple[Request, str]]) -> list[RequestOutput]:
        """Finishes each request with finish_reason "error" and the message; their outputs."""
        outputs = []
        for req, message in failed:
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
            if (out := self.output_processor.fail(req.request_id, message)) is not None:
                outputs.append(out)
        return outputs

    def _drain(self) -> list[RequestOutput]:
        """Waits for the step in flight, if any, and processes its outputs."""
        if self.in_flight is None:
            return []
        sched, launched = self.in_flight
        self.in_flight = None
        result = launched.get_output()
        self._waited += launched.waited
        self._drained_shape = (len(sched.scheduled), launched.num_tokens, launched.recut) \
            if len(launched.verify_rows) == len(sched.scheduled) else None
        self.runner.observe_acceptance(launched, result)
        return self._process_step(sched, result)

    def _process_step(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        for s in sched.scheduled:
            if s.samples:
                s.request.suspect = False  # it sampled in a step that worked: not the cause of an earlier failure
        for rid, rows in result.prompt_logprobs.items():
            self.output_processor.add_prompt_logprobs(rid, rows)
        updated = self.scheduler.update_from_output(sched, result.sampled, result.snapshots_saved)
        refused = self.structured.advance(updated)
        failures = self._fail(refused)
        outputs, stopped, failed = self.output_processor.process(
            [r for r in updated if r.status is not RequestStatus.FINISHED_ERROR] if refused else updated,
            result.logprobs)
        outputs = failures + outputs
        for rid, status in [(rid, RequestStatus.FINISHED_STOPPED) for rid in stopped] + \
                [(rid, RequestStatus.FINISHED_ERROR) for rid in failed]:
            req = self.scheduler.requests.get(rid)
            if req is not None:
                self.scheduler.finish(req, status)
        self.runner.propose_drafts(self.scheduler.running)  # drafts from the tokens on the host (ngram)
        self.runner.remove_finished(self.scheduler.requests)
        return outputs

    def _contain(self, sched: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """A step raised. The model may have updated every row's cache and state before it did, so no row can
        simply run again: each is requeued to be recomputed from its tokens (exact, as after a preemption) and
        marked a suspect, which the scheduler runs alone. A step of one request that fails is that request's
        fault: it alone finishes with finish_reason "error" and everything it held is freed. A request in
        MAX_FAILED_STEPS failed steps fails too, so a fault that needs company cannot loop forever."""
        reqs = [s.request for s in sched.scheduled]
        self.scheduler.discard_saves(sched)
        for s in sched.scheduled:
            s.request.num_output_placeholders -= s.samples  # the step's tokens never come
        culprits = [r for r in reqs if len(reqs) == 1 or r.num_failed_steps + 1 >= MAX_FAILED_STEPS]
        message = f"{type(error).__name__}: {error}"
        if culprits:
            logger.error("request(s) %s failed (%s); other requests continue", [r.request_id for r in culprits],
                         message, exc_info=error)
        else:
            logger.warning("a step of %d requests failed (%s); recomputing them one at a time to find the cause",
                           len(reqs), message, exc_info=error)
        for req in self.scheduler.running:
            req.spec_token_ids = []  # device drafts: the failed step may have overwritten them
        for req in reversed(reqs):  # requeue keeps the step's order at the front of the queue
            req.num_failed_steps += 1
            if req in culprits:
                self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
            elif not req.status.finished:
                self.scheduler.running.remove(req)
                self.scheduler.requeue(req)
                req.suspect = True
        self.runner.remove_finished(self.scheduler.requests)
        return [out for r in culprits if (out := self.output_processor.fail(r.request_id, message)) is not None]

    @property
    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """Engine-wide speculative-decoding counters since start (None without speculation), with adaptive
        verification's own where it runs."""
        stats = self.scheduler.spec_stats
        adaptive = self.runner.adaptive_stats() if stats is not None else None
        return stats if adaptive is None else dataclasses.replace(stats, **adaptive)
