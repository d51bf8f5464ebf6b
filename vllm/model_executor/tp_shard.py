"""Which part of a checkpoint tensor a tensor-parallel rank loads, read from the shapes: a parameter built at
its rank's size (the model's layers divide heads, intermediate widths and the vocabulary by the group size)
differs from the checkpoint's tensor in the one dimension it is split along, by the group size; a replicated
one does not differ. Only that slice is read from the safetensors file (`get_slice`), so no rank reads the
whole checkpoint."""
from __future__ import annotations

import torch

from vllm.transformers_utils.checkpoint_errors import TensorShapeError


def split_dim(name: str, local: torch.Size, ckpt: list[int], world_size: int) -> int | None:
    """The dimension `name` is split along on each of `world_size` ranks (None: replicated), from its local shape
    and the checkpoint's; raises naming the tensor when no split explains the two."""
    if world_size == 1 or list(local) == list(ckpt) or len(local) != len(ckpt):
        return None  # a layout difference (A_log, conv weights) is fit_shape's to settle, on whole tensors
    differ = [d for d in range(len(local)) if local[d] != ckpt[d]]
    if len(differ) == 1 and ckpt[differ[0]] == local[differ[0]] * world_size:
        return differ[0]
    raise TensorShapeError(f"checkpoint tensor {name!r} has shape {list(ckpt)}; a rank of {world_size} "
                           f"tensor-parallel ranks expects {list(local)} (a slice of one dimension)")


def rank_slice(shape: list[int], dim: int, rank: int, world_size: int) -> tuple[slice, ...]:
    size = shape[dim] // world_size
    return tuple(slice(rank * size, (rank + 1) * size) if d == dim else slice(None) for d in range(len(shape)))


def split_whole(name: str, tensor: torch.Tensor, local: torch.Size, rank: int, world_size: int, fit) -> torch.Tensor:
    """A rank's part of a tensor read whole, maybe in another layout (A_log [1, 1, H, 1], conv [P, 1, W]): fit
    (`fit(name, tensor, shape)`) to the whole model's shape, then split along the first dimension, the head or
    channel one. A replicated tensor is only fit."""
    if world_size == 1 or tensor.numel() != local.numel() * world_size:
        return fit(name, tensor, local)
    whole = fit(name, tensor, torch.Size([local[0] * world_size, *local[1:]]))
    return whole[rank * local[0]:(rank + 1) * local[0]]


def check_divisible(config, world_size: int, expert_parallel: bool = False) -> None:
    """Raises ValueError naming each size of the model that the tensor-parallel size does not divide."""
    if world_size == 1:
        return
    # Expert parallelism: whole experts per rank, the shared experts still split by width.
    moe = ({"num_experts": config.num_experts} if expert_parallel else
           {"moe_intermediate_size": config.moe_intermediate_size})
    if expert_parallel and config.num_shared_experts:
        moe["shared experts' intermediate width"] = config.moe_intermediate_size * config.num_shared_experts
    sizes = {"kda_num_heads": config.kda_num_heads if config.kda_layers else world_size,
             "num_attention_heads": config.num_attention_heads if config.mla_layers else world_size,
             "intermediate_size": config.intermediate_size, **moe, "vocab_size": config.vocab_size}
    bad = [f"{name}={value}" for name, value in sizes.items() if value % world_size]
    if bad:
        raise ValueError(f"--tensor-parallel-size {world_size} must divide the model's {', '.join(bad)}: each rank "
                         "holds an equal share of the heads, widths"
                         f"{', experts' if expert_parallel else ''} and vocabulary")
