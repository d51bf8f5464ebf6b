"""AsyncLLM: the server's engine. One background task steps the engine; each request has its own collector.

All engine mutations (add, abort, step) happen in the loop task, one at a time: requests and aborts are
queued by callers and applied between steps, so the engine needs no locks. A step runs in a worker thread
so the event loop keeps serving HTTP while the model computes. A consumer that stops iterating (a client
disconnect, a cancelled task) aborts its request at once, freeing its blocks and state slot.

A request's outputs wait in its `OutputCollector`, which holds at most one: an output the consumer has not
read yet is merged with the next (DELTA outputs concatenate, CUMULATIVE ones are replaced). So a client that
stops reading costs at most its own output's size, never a queue of copies that grows every step.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.llm_engine import LLMEngine, PromptType
from vllm.outputs import OutputJoiner, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.spec_decode.metrics import SpecDecodeStats

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    state_slot_usage: float
    num_free_blocks: int
    num_blocks: int
    num_free_slots: int
    num_slots: int
    prompt_tokens_total: int
    generation_tokens_total: int
    spec_decode: SpecDecodeStats | None = None  # engine-wide speculative-decoding counters


class RequestFailed(RuntimeError):
    """A step failed because of this request; the engine freed it and ran the others on."""


class OutputCollector:
    """One request's unread output (or the exception that ends it): DELTA outputs are joined as they arrive, a
    CUMULATIVE one replaces the unread one (it holds all that one did)."""

    def __init__(self, kind: RequestOutputKind) -> None:
        self.delta = kind is RequestOutputKind.DELTA
        self.joined = OutputJoiner()
        self.item: RequestOutput | Exception | None = None
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | Exception) -> None:
        if self.delta and isinstance(item, RequestOutput):
            self.joined.add(item)
        else:
            self.item = item
        self.ready.set()

    async def get(self) -> RequestOutput | Exception:
        await self.ready.wait()
        self.ready.clear()
        if self.item is not None:  # an exception ends the request, whatever was unread
            item, self.item = self.item, None
            return item
        return self.joined.pop()


@dataclass(slots=True)
class _Pending:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    collector: OutputCollector


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.config = engine.config
        self.collectors: dict[str, OutputCollector] = {}
        self._pending: list[_Pending] = []
        self._aborts: list[str] = []
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.prompt_tokens_total = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLM:
        return cls(LLMEngine.from_engine_args(args))

    def start(self) -> None:
        """Starts the step loop; call from inside the running event loop."""
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of one request, of its sampling_params.output_kind; the last one has finished=True.

        Bad input raises (ValueError) on the first iteration, before any output; a step that fails because of
        this request raises RequestFailed.
        """
        if self._stopping:
            raise RuntimeError("the engine is shutting down")
        self.start()
        if request_id in self.collectors:
            raise ValueError(f"request_id {request_id!r} is already in use")
        collector = OutputCollector(getattr(sampling_params, "output_kind", RequestOutputKind.CUMULATIVE))
        self.collectors[request_id] = collector
        try:
            prompt = await self._tokenized(prompt)
        except BaseException:
            self.collectors.pop(request_id, None)
            raise
        self._pending.append(_Pending(request_id, prompt, sampling_params, collector))
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                item = await collector.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            self.collectors.pop(request_id, None)
            if not finished:  # the consumer went away: free the request's cache now
                self._aborts.append(request_id)
                self._wakeup.set()

    async def _tokenized(self, prompt: PromptType) -> PromptType:
        """Text prompts tokenized in a worker thread, so a long prompt never stalls the event loop (the engine
        loop then only checks the ids)."""
        text = prompt if isinstance(prompt, str) else (
            prompt.get("prompt") if isinstance(prompt, dict) and "prompt_token_ids" not in prompt else None)
        if not isinstance(text, str):
            return prompt
        return {"prompt": text, "prompt_token_ids": await asyncio.to_thread(self.tokenizer.encode, text)}

    async def abort(self, request_id: str) -> None:
        self._aborts.append(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    async def shutdown(self) -> None:
        """Stops the loop; requests still in flight end with finish_reason 'abort'."""
        self._stopping = True
        if self._task is not None:
            self._wakeup.set()
            await self._task
            self._task = None

    def stats(self) -> EngineStats:
        sched, kv = self.engine.scheduler, self.engine.kv_cache_manager
        blocks, slots = kv.usage
        return EngineStats(len(sched.running), len(sched.waiting), blocks, slots, kv.block_pool.num_free,
                           kv.block_pool.num_blocks, len(kv.free_slots), kv.num_state_slots,
                           self.prompt_tokens_total, self.engine.output_processor.num_generation_tokens,
                           self.engine.spec_decode_stats)

    # ---- the loop ---------------------------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply_requests()
            if self._stopping:
                self._abort_all()
                return
            if not self.engine.has_unfinished_requests():
                self._wakeup.clear()
                if not (self._pending or self._aborts or self._stopping):
                    await self._wakeup.wait()
                continue
            try:
                outputs = await loop.run_in_executor(None, self.engine.step)
            except Exception as e:  # a bug, not bad input: fail everyone in flight, keep serving new requests
                logger.exception("engine step failed")
                self._fail_all(e)
                continue
            for out in outputs:
                self._deliver(out)

    def _apply_requests(self) -> None:
        pending, self._pending = self._pending, []
        for p in pending:
            try:
                self.prompt_tokens_total += self.engine.add_request(p.request_id, p.prompt, p.params)
            except Exception as e:  # bad input: only this request fails
                p.collector.put(e)
        aborts, self._aborts = self._aborts, []
        for rid in aborts:
            for out in self.engine.abort_request(rid):
                self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        collector = self.collectors.get(out.request_id)
        if collector is None:
            return
        if out.finished and out.error is not None:
            collector.put(RequestFailed(f"the engine failed while running this request: {out.error}"))
            return
        collector.put(out)

    def _abort_all(self) -> None:
        for out in self.engine.abort_request(list(self.engine.output_processor.parents)):
            self._deliver(out)

    def _fail_all(self, error: Exception) -> None:
        rids = list(self.engine.output_processor.parents)
        self.engine.abort_request(rids)
        for rid in rids:
            collector = self.collectors.get(rid)
            if collector is not None:
                collector.put(RuntimeError(f"the engine failed while running this request: {error}"))
