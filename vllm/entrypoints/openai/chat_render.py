"""The server's chat-template renders, in a small pool of renderer processes: a template is code run on client
data, so no render may hold the event loop, the GIL or the server's memory. The parent kills a render that
overruns its time limit (and starts a fresh process); the renderer caps its memory (RLIMIT_AS) and its output.

Defaults: 2 renderers (one looping template cannot stop the other requests), 10 s per render (a real one takes
milliseconds; tokenizing a whole 1 MiB body takes about 2 s on a slow core), 4 Mi characters of rendered prompt
(4x the default body limit, more than a context window holds) and 2 GiB of memory over a renderer's own
(tokenizing 4 Mi characters peaks near 0.75 GB).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import multiprocessing
import threading
import weakref
from collections.abc import Callable
from typing import Any

from vllm.entrypoints.openai.chat_render_worker import RenderJob, RenderLimits, serve
from vllm.entrypoints.openai.protocol import APIError
from vllm.utils import add_reader_blocking

logger = logging.getLogger("vllm.entrypoints.openai")

STARTUP_TIMEOUT_S = 300.0  # a renderer loads the tokenizer before it is ready (a large one takes a while)
# apply_chat_template's own arguments (and render's variables) that a request may not set through
# chat_template_kwargs: the server sets them, or they change what comes back (tensors, dicts, padding).
RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"})
REQUEST_FIELDS = frozenset({"chat_template", "tools", "add_generation_prompt", "continue_final_message"})


# ---- request checks (in the server) ---------------------------------------------------------------------------

def reserved_kwargs(tokenizer) -> frozenset[str]:
    """RESERVED_KWARGS and whatever else this tokenizer's apply_chat_template takes by name."""
    try:
        params = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    except (TypeError, ValueError):
        return RESERVED_KWARGS
    return RESERVED_KWARGS | {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def check_template_fields(chat_template: str | None, kwargs: dict | None, trusted: bool,
                          reserved: frozenset[str]) -> None:
    """A request's own template needs --trust-request-chat-template (as upstream); chat_template_kwargs holds
    template variables only."""
    kwargs = kwargs or {}
    if not trusted and (chat_template is not None or kwargs.get("chat_template") is not None):
        field_name = "chat_template" if chat_template is not None else "chat_template_kwargs.chat_template"
        raise APIError(400, f"{field_name}: this server does not run chat templates sent in requests (a template "
                            "is code the server runs); the server's own template applies when the field is "
                            "left out, or start the server with --trust-request-chat-template", field_name)
    for key in kwargs:
        if key in reserved:
            own = " (send it as the request's own field)" if key in REQUEST_FIELDS else ""
            raise APIError(400, f"chat_template_kwargs.{key} is not allowed: it is an argument of "
                                f"apply_chat_template, which the server sets{own}; chat_template_kwargs holds the "
                                "template's variables only", f"chat_template_kwargs.{key}")


# ---- the pool (in the server) ---------------------------------------------------------------------------------

def _context():
    """Renderers are forked from a forkserver: a fork of the threaded server could inherit a held lock, and a
    fresh interpreter per renderer would import transformers (seconds) each time one is replaced."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # imported once, in the forkserver; every renderer shares it
    return ctx


class _Slot:
    """One renderer process, or none yet (started on demand, in a thread: starting may wait for the forkserver)."""

    def __init__(self) -> None:
        self.proc = self.conn = None
        self.ready = False
        self.lock = threading.Lock()

    def spawn(self, renderer: ChatRenderer) -> None:
        with self.lock:
            if self.proc is not None or renderer.closed:
                return
            ctx = _context()
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=serve, args=(child, renderer.load_tokenizer, renderer.limits),
                               name="ChatRenderer", daemon=True)
            proc.start()
            child.close()
            self.proc, self.conn, self.ready = proc, conn, False
        if renderer.closed:  # closed while starting: close() may have found no process to stop
            self.stop()

    def stop(self):
        """Kills the process (it holds nothing worth saving) and returns it, to be reaped. The pipe is left to be
        closed when the last reference goes: a thread may still be reading it (it reads the end of the pipe)."""
        proc = self.proc
        self.proc = self.conn = None
        self.ready = False
        if proc is not None:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                proc.kill()
        return proc


def _stop_all(slots: list[_Slot]) -> None:
    for slot in slots:
        proc = slot.stop()
        if proc is not None:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                proc.join(1)


async def _readable(conn) -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    fd = conn.fileno()
    add_reader_blocking(loop, fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; the request was not completed")


class ChatRenderer:
    """Renders RenderJobs in `limits.workers` processes, first come first served; `load_tokenizer` (picklable)
    builds the tokenizer in each, the same one the engine and LLM.chat load, so the ids are theirs."""

    def __init__(self, load_tokenizer: Callable[[], Any], limits: RenderLimits = RenderLimits()) -> None:
        self.load_tokenizer, self.limits = load_tokenizer, limits
        self.closed = False
        self._slots = [_Slot() for _ in range(limits.workers)]
        self._idle = collections.deque(self._slots)
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        # Stopped with the server (close), else when collected or at exit: no renderer outlives its server.
        self._finalizer = weakref.finalize(self, _stop_all, self._slots)

    def start(self) -> None:
        """Starts the renderers in the background, so the first chat request finds them ready."""
        threading.Thread(target=self._spawn_all, name="chat-renderer-start", daemon=True).start()

    def _spawn_all(self) -> None:
        for slot in self._slots:
            try:
                slot.spawn(self)
            except Exception as e:  # noqa: BLE001 - the first request tries again and reports it
                logger.warning("could not start a chat renderer: %s", e)

    async def wait_ready(self) -> None:
        """Until every renderer has loaded its tokenizer; one that failed is logged (a request starts it again)."""
        slots = [await self._acquire() for _ in self._slots]
        try:
            results = await asyncio.gather(*(self._ready(slot) for slot in slots), return_exceptions=True)
        finally:
            for slot in slots:
                self._release(slot)
        for error in results:
            if isinstance(error, BaseException):
                logger.warning("a chat renderer is not ready: %s", error)

    def close(self) -> None:
        """Kills every renderer; renders in flight and waiting end with 503."""
        if self.closed:
            return
        self.closed = True
        for slot in self._slots:
            proc = slot.proc
            if proc is not None:  # a render waiting on it sees the end of its pipe
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    proc.kill()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(_shutting_down())
        threading.Thread(target=self._finalizer, name="chat-renderer-stop", daemon=True).start()

    async def render(self, job: RenderJob) -> list[int] | str:
        slot = await self._acquire()
        try:
            return await self._run(slot, job)
        finally:
            self._release(slot)

    async def _acquire(self) -> _Slot:
        if self.closed:
            raise _shutting_down()
        if self._idle:
            return self._idle.popleft()
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            elif waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._release(waiter.result())  # handed a renderer just as the request went away
            raise

    def _release(self, slot: _Slot) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(slot)
                return
        self._idle.append(slot)

    def _replace(self, slot: _Slot) -> None:
        """Kills the slot's renderer and starts another in the background (reaping the old one there)."""
        proc = slot.stop()

        def respawn() -> None:
            if proc is not None:
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    proc.join(5)
            try:
                slot.spawn(self)
            except Exception as e:  # noqa: BLE001 - the next request tries again and reports it
                logger.warning("could not restart a chat renderer: %s", e)
        threading.Thread(target=respawn, name="chat-renderer-restart", daemon=True).start()

    async def _ready(self, slot: _Slot) -> None:
        if slot.proc is None:
            await asyncio.to_thread(slot.spawn, self)
        if self.closed or slot.proc is None:
            raise _shutting_down()
        if slot.ready:
            return
        try:
            await asyncio.wait_for(_readable(slot.conn), STARTUP_TIMEOUT_S)
            message = await asyncio.to_thread(slot.conn.recv)
        except (TimeoutError, EOFError, OSError) as e:
            message = ("failed", f"{type(e).__name__} {e}")
        except BaseException:  # cancelled while the ready message may be half read: start afresh
            self._replace(slot)
            raise
        if message[0] != "ready":
            slot.stop()  # not restarted in the background: the next request tries (and reports) again
            if self.closed:
                raise _shutting_down()
            raise APIError(500, f"the chat renderer process could not start: {message[1]}")
        slot.ready = True

    async def _run(self, slot: _Slot, job: RenderJob) -> list[int] | str:
        await self._ready(slot)
        conn = slot.conn
        try:
            await asyncio.to_thread(conn.send, job)
            await asyncio.wait_for(_readable(conn), self.limits.timeout_s)
            reply = await asyncio.to_thread(conn.recv)
        except TimeoutError:
            self._replace(slot)
            raise APIError(400, f"the chat template did not finish within {self.limits.timeout_s:g} s (the "
                                "server's limit, --chat-template-timeout): rendering these messages was stopped",
                           "chat_template" if job.from_request else "messages") from None
        except (EOFError, OSError):
            code = slot.proc.exitcode if slot.proc is not None else None
            self._replace(slot)
            if self.closed:
                raise _shutting_down() from None
            raise APIError(400, f"the chat renderer process ended (exit code {code}) while rendering these "
                                "messages: the template or the conversation needs more than the renderer's "
                                f"limits ({self.limits.memory_bytes >> 20} MiB of memory)", "messages") from None
        except BaseException:  # cancelled mid-render (the client left, the server stops): the renderer is busy
            self._replace(slot)
            raise
        if reply[0] == "ok":
            if reply[2]:  # the renderer exits after this reply (it grew, or ran out of memory)
                self._replace(slot)
            return reply[1]
        _, status, message, param, retire = reply
        if retire:
            self._replace(slot)
        raise APIError(status, message, param)
