"""Merged linear weights: several projections of the same input as one GEMM (upstream's MergedColumnParallelLinear,
without the tensor parallelism)."""
import torch
from torch import nn


def merge_linear_weights(*layers: nn.Linear) -> torch.Tensor:
    """The layers' weights stacked along the output dim, [sum of out_features, in_features]; each layer's weight
    becomes a view into it, so the checkpoint names still address it and no second copy is kept."""
    if any(layer.bias is not None for layer in layers):
        raise ValueError("merge_linear_weights merges bias-free projections only")
    merged = torch.cat([layer.weight.data for layer in layers])
    start = 0
    for layer in layers:
        n = layer.out_features
        layer.weight.data = merged[start:start + n]
        start += n
    return merged
