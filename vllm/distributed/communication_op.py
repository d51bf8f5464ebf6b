"""The collectives the model calls on its tensor-parallel group: no-ops for a group of one, so the TP=1 model
runs exactly as before."""
from __future__ import annotations

import torch
import torch.distributed as dist

from vllm.distributed.parallel_state import get_tp_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over the ranks of each rank's partial x (row-parallel outputs), in place."""
    tp = get_tp_group()
    if tp.world_size == 1:
        return x
    dist.all_reduce(x, group=tp.group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Each rank's x concatenated along `dim` in rank order (vocab-parallel logits)."""
    tp = get_tp_group()
    if tp.world_size == 1:
        return x
    dim = dim % x.dim()
    parts = [torch.empty_like(x) for _ in range(tp.world_size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=dim)


def broadcast_object(obj: object, src: int = 0) -> object:
    """`obj` from rank `src` on every rank (pickled; for the step's small host-side messages)."""
    tp = get_tp_group()
    if tp.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=tp.cpu_group)
    return box[0]


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's `value` (each rank sizes its cache from its own free memory; all must agree)."""
    tp = get_tp_group()
    if tp.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    return int(t.item())
