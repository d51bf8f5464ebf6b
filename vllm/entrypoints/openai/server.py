"""`vllm serve`'s uvicorn server: the lifecycle around the app (ready line, drain on SIGTERM, abort on SIGINT, exit
code when the engine core dies), apart from the routes in api_server.py."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI

from vllm.entrypoints.openai.serving_engine import ServerSettings
from vllm.entrypoints.openai.sse import STALL_CHECK_S
from vllm.utils import freeze_gc_heap

logger = logging.getLogger("vllm.entrypoints.openai")


class Server(uvicorn.Server):
    """uvicorn plus: a line once listening; SIGTERM drains requests in flight for --shutdown-timeout seconds, SIGINT
    (and a second signal) aborts them at once; the process exits non-zero if the engine core dies, so that a
    supervisor restarts it; signals are handled here rather than re-raised at exit (uvicorn re-raises each one it
    caught once it has shut down, which turned a second Ctrl-C or a SIGTERM into tracebacks)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, engine, settings: ServerSettings,
                 on_ready: Callable[[str, int], None] | None = None) -> None:
        super().__init__(config)
        self.app, self.engine, self.settings, self.loop = app, engine, settings, None
        self.on_ready = on_ready  # instead of the ready line (one of several API server processes)
        self.exit_code = 0
        engine.dead_handlers.append(self.engine_died)

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            freeze_gc_heap()  # the app, the tokenizer and the engine client live as long as the server
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            if self.on_ready is not None:
                self.on_ready(host, port)
                return
            names = ", ".join(self.settings.served_model_names)
            print(f"vllm API server ready: serving {names} on http://{host}:{port}", flush=True)

    def engine_died(self, error: Exception) -> None:
        """Runs on the loop. Requests in flight have their error already; a server that can run nothing more
        exits, as upstream's does, rather than answering 503 forever."""
        logger.error("%s: the API server exits (code 1) so that its supervisor can restart it", error)
        self.exit_code = 1
        self.should_exit = True
        self.app.state.begin_shutdown()

    def handle_exit(self, sig, frame) -> None:
        # No forced exit on a second signal (uvicorn's): that skips the lifespan shutdown and tears tasks down
        # with tracebacks. A second signal during a drain aborts what is still in flight instead.
        if self.should_exit:
            if self.loop is not None and self.app.state.draining and self.app.state.shutdown_task is None:
                logger.warning("a second signal: aborting the requests still in flight")
                self.loop.call_soon_threadsafe(self.app.state.begin_shutdown)
            else:
                logger.warning("already shutting down (within %d s)", self.config.timeout_graceful_shutdown)
            return
        self.should_exit = True
        if self.loop is not None:  # signal handlers run between bytecodes: hand the work to the loop
            # SIGTERM is a supervisor's stop (a rollout, a scale-down): let requests finish. SIGINT is a person
            # at a terminal who wants the process gone.
            drain = sig == signal.SIGTERM and self.settings.shutdown_timeout_s > 0
            self.loop.call_soon_threadsafe(self.app.state.begin_drain if drain else self.app.state.begin_shutdown)

    async def shutdown(self, sockets=None) -> None:
        reaper = asyncio.ensure_future(self._drop_unflushable())
        try:
            await super().shutdown(sockets)
        finally:
            reaper.cancel()

    async def _drop_unflushable(self) -> None:
        """A connection closed by the server whose client reads nothing (a stalled stream we cut) can never flush
        its last bytes, and uvicorn would wait out the graceful timeout for it: drop such connections."""
        while True:
            await asyncio.sleep(STALL_CHECK_S)
            for connection in list(self.server_state.connections):
                transport = getattr(connection, "transport", None)
                if transport is not None and transport.is_closing():
                    transport.abort()

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
