"""Embedding and lm_head split by vocabulary over the tensor-parallel ranks (upstream's VocabParallelEmbedding /
ParallelLMHead): rank r holds rows [r V/N, (r + 1) V/N). The embedding looks up the ids in its range, zeroes the
others and sums over the ranks; the head's logits are gathered, so sampling sees the whole vocabulary."""
from __future__ import annotations

import torch
from torch import nn

from vllm.distributed.communication_op import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from vllm.distributed.parallel_state import get_tp_group


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        tp = get_tp_group()
        self.num_embeddings = num_embeddings
        self.shard_size = num_embeddings // tp.world_size
        self.start = tp.rank * self.shard_size
        self.tp_size = tp.world_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.shard_size)
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return tensor_model_parallel_all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Float32 logits over the whole vocabulary from this rank's rows of the head."""
    return tensor_model_parallel_all_gather((hidden @ weight.t()).float(), dim=-1)
