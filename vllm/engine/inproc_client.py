"""`InprocClient`: the engine core stepped in a worker thread of the front end's own process (`AsyncLLM` without
multiprocessing; tests use it to reach the engine's internals). All engine mutations (add, abort, step) happen
in its loop task, one at a time: requests and aborts are queued and applied between steps, so the engine needs
no locks. Same contract as `core_client.MPClient` (see its module).
"""
from __future__ import annotations

import asyncio

from vllm.engine.core import EngineCore, EngineStats
from vllm.engine.core_client import OutputSink
from vllm.engine.llm_engine import LLMEngine, PromptType
from vllm.sampling_params import SamplingParams
from vllm.worker.compile_watch import COMPILE_WATCH


class InprocClient:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.core = EngineCore(engine)
        COMPILE_WATCH.install()
        self.config, self.tokenizer = engine.config, engine.tokenizer
        self.dead = False  # a failed step fails its requests, never the engine
        self._sink: OutputSink | None = None
        self._requests: list[tuple[str, PromptType, SamplingParams]] = []
        self._aborts: list[str] = []
        self._calls: list[tuple[str, tuple, asyncio.Future]] = []
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False

    def start(self, sink: OutputSink) -> None:
        """Starts the step loop; call from inside the running event loop."""
        if self._task is None:
            self._sink = sink
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")
            self._task.add_done_callback(self._loop_ended)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> None:
        if self.dead:
            raise RuntimeError("the engine loop has failed; the server cannot run requests")
        self._requests.append((request_id, prompt, params))
        self._wakeup.set()

    def abort(self, request_id: str) -> None:
        self._aborts.append(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    async def call(self, method: str, *args):
        """EngineCore.`method`(*args), run by the loop between steps (never during one)."""
        if self.dead or self._stopping:
            raise RuntimeError("the engine loop is not running")
        future = asyncio.get_running_loop().create_future()
        self._calls.append((method, args, future))
        self._wakeup.set()
        return await future

    async def shutdown(self) -> None:
        """Stops the loop; requests still in flight end with finish_reason 'abort'."""
        self._stopping = True
        if self._task is not None:
            self._wakeup.set()
            await asyncio.gather(self._task, return_exceptions=True)  # a failed loop was reported when it ended
            self._task = None

    def stats(self) -> EngineStats:
        return self.core.stats()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply_requests()
            self._run_calls()
            if self._stopping:
                self._sink.on_outputs(self.core.abort_all(), [])
                return
            if not self.core.has_work():
                self._wakeup.clear()
                if not (self._requests or self._aborts or self._calls or self._stopping):
                    await self._wakeup.wait()
                continue
            self._sink.on_outputs(*await loop.run_in_executor(None, self.core.step))

    def _loop_ended(self, task: asyncio.Task) -> None:
        """A loop that ended other than by shutdown is an engine that can run nothing more: say so, as MPClient
        does when its core process dies."""
        if task.cancelled() or task.exception() is None:
            return
        self.dead = True
        error = task.exception()
        dead = RuntimeError(f"the engine loop failed: {type(error).__name__}: {error}")
        calls, self._calls = self._calls, []
        for _, _, future in calls:
            if not future.done():
                future.set_exception(dead)
        self._sink.on_engine_dead(dead)

    def _apply_requests(self) -> None:
        requests, self._requests = self._requests, []
        rejected = [(rid, error) for rid, prompt, params in requests
                    if (error := self.core.add_request(rid, prompt, params)) is not None]
        aborts, self._aborts = self._aborts, []
        outputs = self.core.abort(aborts) if aborts else []
        if rejected or outputs:
            self._sink.on_outputs(outputs, rejected)

    def _run_calls(self) -> None:
        calls, self._calls = self._calls, []
        for method, args, future in calls:
            value, error = self.core.call(method, args)
            if not future.done():  # its caller may have been cancelled
                if error is None:
                    future.set_result(value)
                else:
                    future.set_exception(error)
