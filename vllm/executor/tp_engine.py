"""TPEngine: rank 0 of a tensor-parallel engine, an LLMEngine that starts the other ranks and hands them each
step's inputs.

Every rank runs the same engine (scheduler, runner, sampler) over the same inputs; its model holds the rank's
share of the weights and the collectives keep the activations, logits and so the sampled tokens identical. So
what rank 0 broadcasts before each step is small: the engine calls made since the last one (requests added,
aborted, finished by the front end, the prefix cache reset). The other ranks make the same calls and run the
same step (tp_worker.py). Sampling and scheduling are deterministic given those inputs (seeded generators,
no timing in the decisions), which is why adaptive verification, whose budgets read measured step times, is
refused under tensor parallelism.

Ranks on this node are processes started here (`python -m vllm.executor.tp_worker`); ranks on other nodes
come from `vllm serve ... --headless` there (run_headless). A rank whose process dies fails the engine at the
next step, naming it; one that stops answering fails it when a collective times out.
"""
from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import time
import weakref

import torch
import torch.distributed as dist

from vllm.config import VllmConfig
from vllm.distributed.communication_op import broadcast_object
from vllm.distributed.parallel_state import destroy_distributed_environment, init_distributed_environment
from vllm.engine.llm_engine import LLMEngine
from vllm.executor.tp_worker import STOP, WorkerSpec, rank_device

logger = logging.getLogger(__name__)

TIMEOUT_ENV = "VLLM_TP_TIMEOUT_S"  # how long a collective waits for a rank before the engine fails
DEFAULT_TIMEOUT_S = 300.0
STOP_WAIT_S = 10.0


class EngineDeadError(RuntimeError):
    """A rank is gone or stuck: the engine cannot go on (EngineCore lets it end the process)."""
    engine_dead = True


def timeout_s() -> float:
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(config: VllmConfig, ranks: range, init_method: str, parent_pid: int | None
                ) -> dict[int, subprocess.Popen]:
    """This node's worker ranks, each a `python -m vllm.executor.tp_worker` process given its spec on stdin."""
    pc = config.parallel_config
    procs = {}
    for rank in ranks:
        spec = WorkerSpec(config, rank, rank - pc.node_rank * pc.ranks_per_node, init_method, timeout_s(),
                          parent_pid)
        proc = subprocess.Popen([sys.executable, "-m", "vllm.executor.tp_worker"], stdin=subprocess.PIPE)
        proc.stdin.write(pickle.dumps(spec))
        proc.stdin.close()
        procs[rank] = proc
    return procs


def stop_ranks(procs: dict[int, subprocess.Popen], wait_s: float = STOP_WAIT_S) -> None:
    deadline = time.monotonic() + wait_s
    for proc in procs.values():
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class TPEngine(LLMEngine):
    def __init__(self, config: VllmConfig, front_end_outputs: bool = False) -> None:
        pc = config.parallel_config
        port = pc.master_port or _free_port()
        init_method = f"tcp://{pc.master_addr}:{port}"
        self.workers = start_ranks(config, range(1, pc.ranks_per_node), init_method, os.getpid())
        # Whatever happens to this object or this process, no rank outlives it.
        self._finalizer = weakref.finalize(self, stop_ranks, self.workers, 0.0)
        self._calls: list[tuple[str, tuple]] = []
        self._threads = torch.get_num_threads()  # rank_device takes this rank's share of the CPU cores
        self._dead: str | None = None
        try:
            init_distributed_environment(pc.tensor_parallel_size, 0, init_method,
                                         rank_device(config, 0), timeout_s(), pc.enable_expert_parallel)
            broadcast_object(front_end_outputs)  # the other ranks build the same output side (tp_worker.py)
            super().__init__(config, front_end_outputs)
        except BaseException:
            self._finalizer()
            destroy_distributed_environment()
            torch.set_num_threads(self._threads)
            raise
        logger.info("tensor parallelism: %d ranks over %d node(s), rendezvous at %s", pc.tensor_parallel_size,
                    pc.nnodes, init_method)

    # ---- the calls the other ranks repeat ----------------------------------------------------------------------
    def add_request(self, request_id, prompt, params, arrival_time=None) -> int:
        n = super().add_request(request_id, prompt, params, arrival_time)
        self._calls.append(("add_request", (request_id, prompt, params, arrival_time)))
        return n

    def abort_request(self, request_ids):
        self._calls.append(("abort_request", (request_ids,)))
        return super().abort_request(request_ids)

    def finish_children(self, finished) -> None:
        self._calls.append(("finish_children", (finished,)))
        super().finish_children(finished)

    def reset_prefix_cache(self) -> bool:
        self._calls.append(("reset_prefix_cache", ()))
        return super().reset_prefix_cache()

    def step(self):
        self._check_ranks()
        calls, self._calls = self._calls, []
        try:
            broadcast_object(calls)
        except Exception as e:  # noqa: BLE001 - a rank that cannot take the step's inputs ends the engine
            raise self._dead_error(e) from e
        return super().step()

    def _contain(self, sched, error):
        # A collective that failed is not a request's fault: the ranks no longer agree, so nothing can go on.
        if isinstance(error, dist.DistError) or self._exited():
            raise self._dead_error(error) from error
        return super()._contain(sched, error)

    # ---- faults and shutdown -------------------------------------------------------------------------------------
    def _exited(self) -> list[str]:
        return [f"rank {rank} (pid {p.pid}) exited with code {p.returncode}" for rank, p in self.workers.items()
                if p.poll() is not None]

    def _check_ranks(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._exited():
            raise self._dead_error(None)

    def _dead_error(self, cause: BaseException | None) -> EngineDeadError:
        exited = self._exited()
        what = "; ".join(exited) if exited else (f"a rank did not answer within {timeout_s():.0f} s "
                                                 f"(${TIMEOUT_ENV}) or its connection broke")
        self._dead = f"tensor-parallel engine failed: {what}" + (f" ({type(cause).__name__}: {cause})"
                                                                 if cause is not None else "")
        logger.error("%s", self._dead)
        self._finalizer()
        return EngineDeadError(self._dead)

    def shutdown(self) -> None:
        """Stops the other ranks (they finish the step they are in) and leaves the process group."""
        if self._dead is None and self._finalizer.alive:
            try:
                broadcast_object(STOP)
            except Exception:  # noqa: BLE001 - a rank already gone: it is killed below
                pass
        stop_ranks(self.workers)
        self._finalizer.detach()
        destroy_distributed_environment()
        torch.set_num_threads(self._threads)


def run_headless(config: VllmConfig) -> int:
    """A node other than 0 (`--headless`): runs its ranks until they end; their exit code."""
    pc = config.parallel_config
    first = pc.node_rank * pc.ranks_per_node
    procs = start_ranks(config, range(first, first + pc.ranks_per_node),
                        f"tcp://{pc.master_addr}:{pc.master_port}", None)
    logger.info("headless node %d: ranks %s, rendezvous at %s:%d", pc.node_rank, list(procs), pc.master_addr,
                pc.master_port)
    try:
        return max(p.wait() for p in procs.values())
    finally:
        stop_ranks(procs, 0.0)
