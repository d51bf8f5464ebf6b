"""How the front end (AsyncLLM) reaches an engine core in a process of the core's own (`MPClient`); the one that
steps the core in the front end's own process is `inproc_client.InprocClient`.

Both clients take requests and aborts at any time from the event loop, hand each turn's outputs to the
`OutputSink` the front end gives `start()`, answer `stats()` without waiting, and run `call()` (an EngineCore
method such as reset_prefix_cache) between two steps. `MPClient` runs the core in a spawned process
(`core_proc.run_engine_core`), the server's default, or is one of several front ends of a core that `vllm serve
--api-server-count N` started (`start_engine_core`). A sender thread writes to the core's pipe, so the event loop
never blocks on a full pipe (which, with the core blocked writing outputs the loop was not reading, would
deadlock); the loop reads outputs as the pipe becomes readable. If the core process dies, every request in flight
fails and so does every new one.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from typing import Protocol

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.core import ABORT, ADD, CALL, FINISH, OUTPUTS, RESULT, SHUTDOWN, STOPPED, EngineStats, Rejected
from vllm.engine.core_proc import await_ready, start_engine_core
from vllm.engine.frontend_outputs import FrontEndOutputs
from vllm.engine.llm_engine import PromptType
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.tokenizer import get_tokenizer
from vllm.utils import add_reader_blocking

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 30  # for the core to abort what is in flight and answer; then its process is killed


class OutputSink(Protocol):
    def on_outputs(self, outputs: list[RequestOutput], rejected: Rejected) -> None: ...

    def on_engine_dead(self, error: Exception) -> None: ...


class MPClient:
    def __init__(self, args: EngineArgs | None, attach: tuple | None = None) -> None:
        """Spawns the core for `args`; or, with `attach` = (to_core, from_core, config, stats), is one of the
        front ends of a core already started (`vllm serve --api-server-count N`), whose process is not ours."""
        if attach is None:
            self.proc, ((self._to_core, self._from_core),) = start_engine_core(args)
        else:
            self.proc, (self._to_core, self._from_core, self.config, self._stats) = None, attach
        try:
            if attach is None:
                self.config, self._stats = await_ready(self._from_core, self.proc)
            mc = self.config.model_config
            self.tokenizer = get_tokenizer(mc.tokenizer, trust_remote_code=mc.trust_remote_code)
            # The core sends records; detokenization and the outputs happen here (frontend_outputs.py).
            self._outputs = FrontEndOutputs(self.tokenizer, self.config.num_speculative_tokens)
        except BaseException as e:  # a bad checkpoint, Ctrl-C while loading: nothing may outlive us
            self._reap(0 if isinstance(e, KeyboardInterrupt) else 5)
            raise
        self.dead = self._closed = False
        self._sink: OutputSink | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Future | None = None
        self._calls: dict[int, asyncio.Future] = {}  # calls sent, by id, until the core answers
        self._call_ids = itertools.count()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="engine-core-sender", daemon=True)
        self._sender.start()

    def start(self, sink: OutputSink) -> None:
        """Starts reading outputs; call from inside the running event loop."""
        if self._loop is None:
            self._sink, self._loop = sink, asyncio.get_running_loop()
            self._stopped = self._loop.create_future()
            add_reader_blocking(self._loop, self._from_core.fileno(), self._on_readable)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> None:
        if self.dead:
            raise RuntimeError("the engine process has died; the server cannot run requests")
        if request_id in self._outputs.children:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, dict):
            text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        else:
            text, ids = (prompt, None) if isinstance(prompt, str) else (None, list(prompt))
        if isinstance(params, SamplingParams) and isinstance(params.n, int) and params.n >= 1:
            self._outputs.add(request_id, text, ids, params)  # else the core refuses it, naming the problem
        self._outbox.put((ADD, request_id, prompt, params))

    def abort(self, request_id: str) -> None:
        if not self.dead:
            self._outbox.put((ABORT, request_id))

    async def call(self, method: str, *args):
        """EngineCore.`method`(*args), run in the core process between steps."""
        if self.dead or self._closed:
            raise RuntimeError("the engine process is not running")
        call_id = next(self._call_ids)
        future = self._calls[call_id] = self._loop.create_future()
        self._outbox.put((CALL, call_id, method, args))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    async def shutdown(self) -> None:
        """Asks the core to abort what is in flight and exit (its outputs arrive first), then reaps it."""
        if self._closed:
            return
        self._closed = True
        if not self.dead:
            self._outbox.put((SHUTDOWN,))
            if self._stopped is not None and not self._stopped.done():
                try:
                    await asyncio.wait_for(asyncio.shield(self._stopped), SHUTDOWN_TIMEOUT_S)
                except TimeoutError:
                    logger.warning("the engine process did not stop within %d s; killing it", SHUTDOWN_TIMEOUT_S)
        self._outbox.put(None)  # the sender writes what is queued, then ends
        await asyncio.to_thread(self._sender.join, SHUTDOWN_TIMEOUT_S)
        await asyncio.to_thread(self._reap, SHUTDOWN_TIMEOUT_S)

    def stats(self) -> EngineStats:
        """As of the core's last message: at most one step old."""
        return self._stats

    # ---- the pipe ---------------------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                self._to_core.send(msg)
            except OSError:  # the core is gone; the reader reports it
                return

    def _on_readable(self) -> None:
        try:
            while self._from_core.poll():
                msg = self._from_core.recv()
                if msg[0] == RESULT:
                    self._answer(*msg[1:])
                    continue
                kind, records, rejected, self._stats = msg
                self._deliver(records, rejected)
                if kind == STOPPED:  # calls sent before SHUTDOWN were answered before this
                    self._close_reader()
                    self._fail_calls(RuntimeError("the engine process stopped"))
                    self._stopped.set_result(None)
                    return
                assert kind == OUTPUTS, kind
        except (EOFError, OSError):
            self._close_reader()
            self._engine_died()

    def _deliver(self, records: list, rejected: Rejected) -> None:
        for rid, _ in rejected:
            self._outputs.discard(rid)
        try:
            outputs, finished = self._outputs.apply(records)
        except Exception as e:  # noqa: BLE001 -- a bug here must not kill the reader: the engine serves on
            logger.exception("building outputs failed")
            outputs, finished = [], []
            failed = self._outputs.parents_of(records)
            rejected = rejected + [(rid, RuntimeError(f"building this request's output failed: {e}")) for rid in failed]
            for rid in failed:
                self._outputs.discard(rid)
                self.abort(rid)
        if finished:
            self._outbox.put((FINISH, finished))
        self._sink.on_outputs(outputs, rejected)

    def _answer(self, call_id: int, value, error: Exception | None) -> None:
        future = self._calls.get(call_id)
        if future is None or future.done():  # its caller was cancelled
            return
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)

    def _fail_calls(self, error: Exception) -> None:
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)

    def _engine_died(self) -> None:
        self.dead = True
        code = "?"
        if self.proc is not None:
            self.proc.join(1)
            code = self.proc.exitcode
        error = RuntimeError(f"the engine process died (exit code {code}); its log says why")
        self._fail_calls(error)
        self._stopped.set_result(None)
        self._sink.on_engine_dead(error)

    def _close_reader(self) -> None:
        self._loop.remove_reader(self._from_core.fileno())

    def _reap(self, timeout: float) -> None:
        """Waits for our core process to exit (killing it after `timeout`); an attached front end's core is not
        ours: closing the pipes is all (shutdown() waited for its STOPPED)."""
        if self.proc is not None:
            self.proc.join(timeout)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
        self._to_core.close()
        self._from_core.close()
