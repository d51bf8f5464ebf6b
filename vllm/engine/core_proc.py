"""The engine core process (EngineCoreProc upstream): `start_engine_core` spawns it with a pipe pair per front end,
`run_engine_core` is its main, and `_CoreServer` its loop over the front ends' pipes (the protocol: core.py's
docstring; which front end owns each request: core_router.py)."""
from __future__ import annotations

import logging
import multiprocessing
import selectors
import signal
import time
from multiprocessing.connection import Connection

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.core import (ABORT, ADD, CALL, FAILED, FINISH, OUTPUTS, READY, RESULT, STOPPED, EngineCore,
                              Rejected, portable)
from vllm.engine.core_router import ClientRouter, Routed
from vllm.engine.llm_engine import LLMEngine
from vllm.logger import init_logging
from vllm.utils import freeze_gc_heap
from vllm.worker.compile_watch import COMPILE_WATCH

logger = logging.getLogger(__name__)


def start_engine_core(args: EngineArgs, num_clients: int = 1) -> tuple[multiprocessing.Process, list[tuple]]:
    """Spawns the engine core process with a pipe pair per front end: (its process, [(to_core, from_core)])."""
    ctx = multiprocessing.get_context("spawn")  # a forked child would inherit CUDA and the loop's threads
    ends = [(ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)) for _ in range(num_clients)]
    inboxes = [inbox for (inbox, _), _ in ends]
    outboxes = [outbox for _, (_, outbox) in ends]
    proc = ctx.Process(target=run_engine_core, name="EngineCore", daemon=True,
                       args=(args, inboxes, outboxes, logging.getLogger().getEffectiveLevel()))
    proc.start()
    for conn in inboxes + outboxes:  # the child's ends: closed here, so a pipe reports EOF when the child is gone
        conn.close()
    return proc, [(to_core, from_core) for (_, to_core), (from_core, _) in ends]


def await_ready(from_core, proc: multiprocessing.Process | None) -> tuple:
    """The core's (config, stats) once it has started; its error if it failed to."""
    try:
        msg = from_core.recv()
    except EOFError:
        code = "?"
        if proc is not None:
            proc.join(5)
            code = proc.exitcode
        raise RuntimeError(f"the engine process exited with code {code} while starting; its log above says "
                           "why") from None
    if msg[0] == FAILED:
        raise msg[1]
    assert msg[0] == READY, msg[0]
    return msg[1], msg[2]


def run_engine_core(args: EngineArgs, inboxes: list[Connection], outboxes: list[Connection], log_level: int) -> None:
    """The engine core process's main (EngineCoreProc upstream): builds the engine, then serves its front ends'
    pipes (one pair each: several with --api-server-count) until each has sent SHUTDOWN or gone away (its end of
    the pipe closes)."""
    # A Ctrl-C reaches the whole process group; the front end turns it into a SHUTDOWN that ends the requests
    # in flight cleanly. SIGTERM keeps its default: it is how the front end's exit reaps a core it could not stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    init_logging(log_level)
    try:
        core = EngineCore(LLMEngine.from_engine_args(args, front_end_outputs=True))
    except BaseException as e:  # noqa: BLE001 - the front end reports it and exits
        if not isinstance(e, ValueError):  # bad input is one line there; anything else keeps its traceback here
            logger.exception("the engine failed to start")
        for outbox in outboxes:
            outbox.send((FAILED, portable(e)))
        return
    freeze_gc_heap()  # the engine lives as long as this process
    COMPILE_WATCH.install()  # from here on a Triton compile stalls the requests in flight: say so
    try:
        for outbox in outboxes:
            outbox.send((READY, core.engine.config, core.stats()))
    except OSError:
        logger.warning("a front end went away while the engine started; the engine core exits")
        return
    _CoreServer(core, inboxes, outboxes).serve()


# A front end that got no outputs in a turn still hears the core's stats this often (its /metrics gauges), and
# whenever the core goes idle; with one front end, after every turn that changed something.
STATS_EVERY_S = 0.05


class _CoreServer:
    """The core process's loop over its front ends' pipes: apply what they sent, step, send each its outputs."""

    def __init__(self, core: EngineCore, inboxes: list[Connection], outboxes: list[Connection]) -> None:
        self.core, self.inboxes, self.outboxes = core, inboxes, outboxes
        self.router = ClientRouter(len(inboxes))
        self.attached = dict(enumerate(inboxes))  # client index -> its inbox, until it leaves
        self.selector = selectors.DefaultSelector()  # kept, not built per wait (multiprocessing's wait() does)
        for client, inbox in self.attached.items():
            self.selector.register(inbox, selectors.EVENT_READ, client)
        self.pending: Routed = {}  # per client, the records and rejections of this turn not sent yet
        self.stats_sent = [0.0] * len(inboxes)

    def serve(self) -> None:
        core = self.core
        while self.attached:
            changed = False
            idle = not core.has_work()  # idle: sleep until a front end sends something
            while self.attached and (ready := self._ready(block=idle)):
                idle, changed = False, True
                for client in ready:
                    if client in self.attached:  # not gone earlier in this batch
                        self._receive(client)
            if core.has_work():
                self._collect(*core.step())
                changed = True
            if changed:
                self._send(going_idle=not core.has_work())
        logger.info("every front end has left; the engine core exits")

    def _ready(self, block: bool) -> list[int]:
        if len(self.attached) == 1:
            ((client, inbox),) = self.attached.items()
            return [client] if block or inbox.poll() else []
        return [key.data for key, _ in self.selector.select(None if block else 0)]

    def _receive(self, client: int) -> None:
        core, router = self.core, self.router
        try:
            msg = self.attached[client].recv()
        except (EOFError, OSError):
            logger.warning("front end %d went away; its requests are aborted", client)
            self._leave(client)
            return
        kind = msg[0]
        if kind == ADD:
            error = core.add_request(*msg[1:])
            if error is None:
                router.add(client, msg[1], core.engine.output_processor.child_ids(msg[1]))
            else:
                self.pending.setdefault(client, ([], []))[1].append((msg[1], portable(error)))
        elif kind == ABORT:
            if router.owns(client, msg[1]):
                self._collect(core.abort(msg[1]), [])
        elif kind == FINISH:
            core.engine.finish_children(router.own_children(client, msg[1]))
        elif kind == CALL:
            self._post(client, (RESULT, msg[1], *core.call(msg[2], msg[3])))
        else:  # SHUTDOWN: this front end is leaving; its requests end with finish_reason "abort"
            records, rejected = self._leave(client)
            self._post(client, (STOPPED, records, rejected, core.stats()))

    def _leave(self, client: int) -> tuple[list, list]:
        """Aborts the client's requests and detaches it; returns what it had not been sent yet."""
        core = self.core
        mine = core.abort_all() if len(self.inboxes) == 1 else core.abort(self.router.requests_of(client))
        self._collect(mine, [])
        if self.attached.pop(client, None) is not None:
            self.selector.unregister(self.inboxes[client])
        return self.pending.pop(client, ([], []))

    def _collect(self, records: list, rejected: Rejected) -> None:
        for client, (recs, rejs) in self.router.route(records, rejected).items():
            if client in self.attached:
                mine = self.pending.setdefault(client, ([], []))
                mine[0].extend(recs)
                mine[1].extend(rejs)

    def _send(self, going_idle: bool) -> None:
        stats, now = self.core.stats(), time.monotonic()
        pending, self.pending = self.pending, {}
        for client in list(self.attached):
            records, rejected = pending.get(client) or ([], [])
            if (records or rejected or len(self.inboxes) == 1 or going_idle
                    or now - self.stats_sent[client] >= STATS_EVERY_S):
                self._post(client, (OUTPUTS, records, rejected, stats))
                self.stats_sent[client] = now

    def _post(self, client: int, msg: tuple) -> None:
        try:
            self.outboxes[client].send(msg)
        except OSError:  # it is gone; its inbox reports EOF next
            logger.warning("front end %d went away; its requests are aborted", client)
            if client in self.attached:
                self._leave(client)
