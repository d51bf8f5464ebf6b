"""A tensor-parallel rank other than 0: `python -m vllm.executor.tp_worker` with a pickled WorkerSpec on stdin.

It joins the rendezvous, builds the same engine as rank 0 (its model holds this rank's share), then repeats:
receive the step's inputs from rank 0 (the engine calls made since the last step), make the same calls, run the
same step. The engines are deterministic, so every rank schedules the same step; the model's collectives keep
their tensors identical. It exits on rank 0's STOP, when rank 0's process is gone, or when a collective fails.
"""
from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from dataclasses import dataclass

import torch

from vllm.config import VllmConfig

logger = logging.getLogger("vllm.executor.tp_worker")

STOP = "stop"
PARENT_POLL_S = 0.5


@dataclass(slots=True)
class WorkerSpec:
    config: VllmConfig
    rank: int
    local_rank: int
    init_method: str
    timeout_s: float
    parent_pid: int | None  # the process whose death ends this one (None: a headless node's ranks)


def rank_device(config: VllmConfig, local_rank: int) -> torch.device:
    """The rank's device (cuda:local_rank); on CPU the rank also takes its share of the cores."""
    device = config.model_config.device
    if device.type == "cuda":
        return torch.device("cuda", local_rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.parallel_config.ranks_per_node))
    return device


def watch_parent(pid: int) -> None:
    """No rank outlives the engine: exit at once when the process that started this one is gone."""
    def poll() -> None:
        while True:
            if os.getppid() != pid:
                os._exit(1)
            time.sleep(PARENT_POLL_S)
    threading.Thread(target=poll, name="parent-watch", daemon=True).start()


def run_worker(spec: WorkerSpec) -> None:
    from vllm.distributed.communication_op import broadcast_object
    from vllm.distributed.parallel_state import destroy_distributed_environment, init_distributed_environment
    from vllm.engine.llm_engine import LLMEngine
    if spec.parent_pid is not None:
        watch_parent(spec.parent_pid)
    pc = spec.config.parallel_config
    init_distributed_environment(pc.tensor_parallel_size, spec.rank, spec.init_method,
                                 rank_device(spec.config, spec.local_rank), spec.timeout_s,
                                 pc.enable_expert_parallel)
    try:
        # As rank 0's engine: its output side decides when stop strings end requests (in this process, or in the
        # front end, which then finishes them through a broadcast call), and every rank must end them alike.
        front_end_outputs = broadcast_object(None)
        engine = LLMEngine(spec.config, front_end_outputs)
        while True:
            message = broadcast_object(None)
            if message == STOP:
                break
            for method, args in message:
                getattr(engine, method)(*args)
            engine.step()
    finally:
        destroy_distributed_environment()


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(asctime)s [tp rank] %(message)s")
    spec: WorkerSpec = pickle.load(sys.stdin.buffer)
    try:
        run_worker(spec)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
