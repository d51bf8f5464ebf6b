"""AsyncLLM: the server's engine front end. Each request has its own collector; an engine core client
(`core_client.py`) runs the steps, by default in a process of its own.

A consumer that stops iterating (a client disconnect, a cancelled task) aborts its request at once, freeing its
blocks and state slot.

A request's outputs wait in its `OutputCollector`, which holds at most one: an output the consumer has not
read yet is merged with the next (DELTA outputs concatenate, CUMULATIVE ones are replaced). So a client that
stops reading costs at most its own output's size, never a queue of copies that grows every step; and a front
end that falls behind the engine (many streams on one event loop) sends fewer, larger deltas rather than
slowing the engine down.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.core import EngineStats, Rejected
from vllm.engine.core_client import MPClient
from vllm.engine.inproc_client import InprocClient
from vllm.engine.llm_engine import LLMEngine
from vllm.inputs import PromptType
from vllm.inputs.validation import text_problem
from vllm.envs import enable_multiprocessing
from vllm.outputs import OutputJoiner, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


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


class AsyncLLM:
    def __init__(self, client: InprocClient | MPClient) -> None:
        self.client = client
        self.tokenizer = client.tokenizer
        self.config = client.config
        self.collectors: dict[str, OutputCollector] = {}
        self._stopping = False
        # Called once if the engine core dies (the server exits so that its supervisor restarts it).
        self.dead_handlers: list[Callable[[Exception], None]] = []

    @classmethod
    def from_engine_args(cls, args: EngineArgs, multiprocess: bool | None = None) -> AsyncLLM:
        """The engine core in a process of its own unless `multiprocess` is False (default: the environment's
        VLLM_ENABLE_V1_MULTIPROCESSING, on unless "0")."""
        if multiprocess is None:
            multiprocess = enable_multiprocessing()
        return cls(MPClient(args) if multiprocess else InprocClient(LLMEngine.from_engine_args(args)))

    @property
    def errored(self) -> bool:
        """The engine core is gone (its process died): no request can run any more."""
        return self.client.dead

    def start(self) -> None:
        """Starts the engine loop; call from inside the running event loop."""
        self.client.start(self)

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
            self.client.add_request(request_id, prompt, sampling_params)
        except BaseException:
            self.collectors.pop(request_id, None)
            raise
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
                self.client.abort(request_id)

    async def _tokenized(self, prompt: PromptType) -> PromptType:
        """Text prompts tokenized in a worker thread, so a long prompt never stalls the event loop (the engine
        loop then only checks the ids)."""
        text = prompt if isinstance(prompt, str) else (
            prompt.get("prompt") if isinstance(prompt, dict) and "prompt_token_ids" not in prompt else None)
        if not isinstance(text, str):
            return prompt
        if (problem := text_problem(text)) is not None:  # before the tokenizer, which raises TypeError on it
            raise ValueError(problem)
        return {"prompt": text, "prompt_token_ids": await asyncio.to_thread(self.tokenizer.encode, text)}

    async def abort(self, request_id: str) -> None:
        self.client.abort(request_id)

    async def shutdown(self) -> None:
        """Stops the engine; requests still in flight end with finish_reason 'abort'."""
        self._stopping = True
        await self.client.shutdown()

    def stats(self) -> EngineStats:
        return self.client.stats()

    async def reset_prefix_cache(self) -> bool:
        """Forgets the cached prefixes (upstream's AsyncLLM.reset_prefix_cache); run by the engine core between
        steps. True once done."""
        self.start()
        return await self.client.call("reset_prefix_cache")

    # ---- the client's OutputSink ------------------------------------------------------------------------------
    def on_outputs(self, outputs: list[RequestOutput], rejected: Rejected) -> None:
        for out in outputs:
            collector = self.collectors.get(out.request_id)
            if collector is None:
                continue
            if out.finished and out.error is not None:
                collector.put(RequestFailed(f"the engine failed while running this request: {out.error}"))
            else:
                collector.put(out)
        for rid, error in rejected:
            collector = self.collectors.get(rid)
            if collector is not None:
                collector.put(error)

    def on_engine_dead(self, error: Exception) -> None:
        for collector in self.collectors.values():
            collector.put(error)
        if not self.dead_handlers:
            logger.error("%s", error)
        for handler in self.dead_handlers:
            handler(error)


# Upstream's name for the asynchronous engine (its V1 AsyncLLMEngine is this class too).
AsyncLLMEngine = AsyncLLM
