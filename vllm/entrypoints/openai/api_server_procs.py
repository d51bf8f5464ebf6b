"""`vllm serve --api-server-count N`: N API server processes over one engine core (upstream's multi-API-server
mode). One server's HTTP, detokenization and response building run on one Python thread, and at tens of
thousands of streamed events a second that thread is the ceiling (docs/serving.md); N of them share the
listening socket and the core.

The launcher (`APIServerLauncher`, the `vllm serve` process) binds the socket, starts the core with a pipe pair
per server and waits for it to load, then spawns the servers, each with its pipes and the socket. It prints one
ready line once all of them listen and forwards SIGINT and SIGTERM to them: each drains or aborts as a lone
server does, then leaves the core, which exits when the last has left. If a server exits while the others
serve, the launcher stops them all and exits non-zero, so that a supervisor restarts the whole (upstream's
rule). The servers run in a process group of their own, so a terminal's Ctrl-C reaches them once, through the
launcher; the launcher's death sends them SIGTERM (PR_SET_PDEATHSIG), so none outlives it.

What the servers share, in directories the launcher makes and removes: /metrics through prometheus_client's
multiprocess mode (PROMETHEUS_MULTIPROC_DIR), so every server's /metrics sums the request histograms and counters
of all of them (the engine's gauges and counters come from the core's stats, the same in each); and the stored
/v1/responses (response_store.py), so GET and previous_response_id find a response whichever server made it.
What stays per process: /load's count, and each server's two chat renderer processes.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
from multiprocessing.connection import Connection, wait

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.core_client import SHUTDOWN_TIMEOUT_S
from vllm.engine.core_proc import await_ready, start_engine_core
from vllm.entrypoints.openai.serving_engine import ServerSettings

logger = logging.getLogger("vllm.entrypoints.openai")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_PR_SET_PDEATHSIG = 1


class APIServerLauncher:
    def __init__(self, args: EngineArgs, settings: ServerSettings, sock: socket.socket, count: int,
                 uvicorn_log_level: str) -> None:
        self.args, self.settings, self.sock, self.count = args, settings, sock, count
        self.uvicorn_log_level = uvicorn_log_level
        self.core: multiprocessing.Process | None = None
        self.servers: list[multiprocessing.Process] = []
        self.stopping = False
        self.signalled: int | None = None  # the last signal forwarded
        self.shared_dirs: list[str] = []

    def start_core(self) -> None:
        """Starts the engine core and waits until it has loaded (its error if it could not)."""
        self.shared_dirs = [tempfile.mkdtemp(prefix="vllm-responses-")]
        self.settings = dataclasses.replace(self.settings, response_store_dir=self.shared_dirs[0])
        if not os.environ.get(MULTIPROC_ENV):  # a directory the user set is theirs: used, and left in place
            self.shared_dirs.append(tempfile.mkdtemp(prefix="vllm-metrics-"))
            os.environ[MULTIPROC_ENV] = self.shared_dirs[-1]  # before any server imports prometheus_client
        self.core, self.pipes = start_engine_core(self.args, self.count)
        try:
            self.readies = [await_ready(from_core, self.core) for _, from_core in self.pipes]
        except BaseException as e:  # a Ctrl-C while loading: nothing to wait for
            self.stop_core(0 if isinstance(e, KeyboardInterrupt) else 5)
            raise

    def stop_core(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Ends the core (started, servers not): closing its pipes is every front end leaving."""
        for to_core, from_core in self.pipes:
            to_core.close()
            from_core.close()
        self.core.join(timeout)
        if self.core.is_alive():
            self.core.kill()
            self.core.join()
        self._remove_shared_dirs()

    def serve(self) -> int:
        """Runs the servers until they have all exited; the exit code for `vllm serve`."""
        ctx = multiprocessing.get_context("spawn")
        ready_conns = []
        log_level = logging.getLogger().getEffectiveLevel()
        # Forwarded from now on: a signal while the servers start reaches each once it is started.
        previous = {sig: signal.signal(sig, self._forward) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for i, ((to_core, from_core), (config, stats)) in enumerate(zip(self.pipes, self.readies)):
                ready_recv, ready_send = ctx.Pipe(duplex=False)
                # Not daemonic: a server starts chat renderer processes of its own.
                proc = ctx.Process(target=run_api_server, name=f"APIServer-{i}",
                                   args=(i, os.getpid(), self.settings, self.sock, (to_core, from_core, config, stats),
                                         ready_send, log_level, self.uvicorn_log_level))
                proc.start()
                self.servers.append(proc)
                ready_send.close()
                ready_conns.append(ready_recv)
                if self.signalled is not None:
                    os.kill(proc.pid, self.signalled)
            for to_core, from_core in self.pipes:  # the servers hold them now: the core sees EOF when they go
                to_core.close()
                from_core.close()
            return self._watch(ready_conns)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._reap()

    def _watch(self, ready_conns: list[Connection]) -> int:
        exit_code, ready = 0, 0
        alive = {p.sentinel: p for p in self.servers}
        core_sentinel = self.core.sentinel
        while alive:
            for obj in wait([*alive, *ready_conns, *([core_sentinel] if core_sentinel else [])]):
                if obj is core_sentinel:
                    core_sentinel = None  # each server reports it and exits 1
                    if not self.stopping:
                        logger.error("the engine core process died (exit code %s)", self.core.exitcode)
                elif isinstance(obj, Connection):
                    ready_conns.remove(obj)
                    with contextlib.suppress(EOFError, OSError):
                        obj.recv()
                        ready += 1
                        if ready == self.count:
                            self._announce()
                else:
                    proc = alive.pop(obj)
                    proc.join()
                    if proc.exitcode != 0 or not self.stopping:
                        exit_code = 1
                    if not self.stopping:
                        logger.error("API server %s exited (code %s) while serving: stopping the others so that "
                                     "a supervisor restarts the whole server", proc.name, proc.exitcode)
                        self._signal_servers(signal.SIGTERM)
        return exit_code

    def _forward(self, sig, frame) -> None:
        """SIGINT and SIGTERM mean to each server what they mean to a lone one, a second one included."""
        self.signalled = sig
        self._signal_servers(sig)

    def _signal_servers(self, sig: int) -> None:
        self.stopping = True
        for proc in self.servers:
            if proc.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, sig)

    def _announce(self) -> None:
        host, port = self.sock.getsockname()[:2]
        names = ", ".join(self.settings.served_model_names)
        print(f"vllm API server ready: serving {names} on http://{host}:{port} ({self.count} API server "
              "processes)", flush=True)

    def _reap(self) -> None:
        """No process outlives `vllm serve`: the servers have exited (or are killed), then the core, which exits
        once they have all left."""
        for proc in self.servers:
            proc.join(SHUTDOWN_TIMEOUT_S if proc.exitcode is None else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.core.join(SHUTDOWN_TIMEOUT_S)
        if self.core.is_alive():
            logger.warning("the engine core did not exit after its front ends left; killing it")
            self.core.kill()
            self.core.join()
        self._remove_shared_dirs()

    def _remove_shared_dirs(self) -> None:
        for d in self.shared_dirs:
            shutil.rmtree(d, ignore_errors=True)
        self.shared_dirs = []


def run_api_server(index: int, launcher_pid: int, settings: ServerSettings, sock: socket.socket, attach: tuple,
                   ready: Connection, log_level: int, uvicorn_log_level: str) -> None:
    """An API server process's main: AsyncLLM on its pipes to the shared core, serving the shared socket."""
    os.setpgrp()  # a terminal's Ctrl-C reaches the launcher alone, which forwards it once
    _die_with(launcher_pid)
    from vllm.engine.async_llm import AsyncLLM
    from vllm.engine.core_client import MPClient
    from vllm.entrypoints.openai.api_server import run_server
    from vllm.logger import init_logging
    init_logging(log_level)

    def on_ready(host: str, port: int) -> None:
        ready.send(index)
        ready.close()
    engine = AsyncLLM(MPClient(None, attach=attach))
    sys.exit(run_server(engine, settings, sock, uvicorn_log_level, on_ready))


def _die_with(launcher_pid: int) -> None:
    """SIGTERM (a drain) when the launcher dies, however it dies (Linux); at once if it already has."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != launcher_pid:
        os.kill(os.getpid(), signal.SIGTERM)
