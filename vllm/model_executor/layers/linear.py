"""Merged linear weights: several projections of the same input as one GEMM (upstream's MergedColumnParallelLinear,
without the tensor parallelism)."""
import torch
from torch import nn


def merge_linear_weights(*layers: nn.Linear, pad_to: int = 1) -> torch.Tensor:
    """The layers' weights stacked along the output dim, [sum of out_features, in_features]; each layer's weight
    becomes a view into it, so the checkpoint names still address it and no second copy is kept. `pad_to`: zero
    rows after the last layer's, up to a multiple of it (8 keeps the output's rows 16-byte aligned in bf16, so
    that column slices of it stay aligned for the kernels that read them in place)."""
    if any(layer.bias is not None for layer in layers):
        raise ValueError("merge_linear_weights merges bias-free projections only")
    weights = [layer.weight.data for layer in layers]
    pad = -sum(w.shape[0] for w in weights) % pad_to
    merged = torch.cat(weights + [weights[0].new_zeros(pad, weights[0].shape[1])] if pad else weights)
    start = 0
    for layer in layers:
        n = layer.out_features
        layer.weight.data = merged[start:start + n]
        start += n
    return merged


def stack_linear_weights(*layers: nn.Linear) -> torch.Tensor:
    """Same-shaped layers' weights as one [n, out_features, in_features] tensor for a batched GEMM (projections of
    different inputs); each layer's weight becomes a view into it, as merge_linear_weights leaves them."""
    if any(layer.bias is not None for layer in layers) or len({layer.weight.shape for layer in layers}) != 1:
        raise ValueError("stack_linear_weights stacks bias-free projections of one shape only")
    stacked = torch.stack([layer.weight.data for layer in layers])
    for i, layer in enumerate(layers):
        layer.weight.data = stacked[i]
    return stacked
