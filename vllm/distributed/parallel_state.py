"""The tensor-parallel group this process belongs to (upstream's `get_tp_group`): its rank and size, and the
torch.distributed process group the collectives run on (NCCL on CUDA, gloo on CPU). A process that never joined
one is rank 0 of a group of one, and every collective is the identity."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class GroupCoordinator:
    rank: int = 0
    world_size: int = 1
    group: object | None = None  # the torch.distributed ProcessGroup; None for a group of one
    backend: str = ""
    # MoE layers hold whole experts per rank (expert parallelism over the same ranks) instead of a slice of each.
    expert_parallel: bool = False
    cpu_group: object | None = None  # gloo, for host objects (the step's inputs); the same group on CPU

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0


_TP = GroupCoordinator()


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed_environment(world_size: int, rank: int, init_method: str, device: torch.device,
                                 timeout_s: float = 600.0, expert_parallel: bool = False) -> GroupCoordinator:
    """Joins the world of `world_size` processes through torch.distributed's rendezvous at `init_method`
    (tcp://host:port), all of them one tensor-parallel group. Each collective waits at most `timeout_s`."""
    global _TP
    if world_size == 1:
        _TP = GroupCoordinator(expert_parallel=expert_parallel)
        return _TP
    backend = backend_for(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank,
                                timeout=timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    cpu_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo",
                                                                          timeout=timedelta(seconds=timeout_s))
    _TP = GroupCoordinator(rank, world_size, dist.group.WORLD, backend, expert_parallel, cpu_group)
    return _TP


def set_tp_group(group: GroupCoordinator) -> None:
    """For tests that build ranks by hand."""
    global _TP
    _TP = group


def destroy_distributed_environment() -> None:
    global _TP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP = GroupCoordinator()
