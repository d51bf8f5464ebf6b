"""DSparkProposer: the DSpark draft inside the model runner, on the runner's device.

Each step the target's forward fills a persistent buffer with its hidden states at the draft's
`target_layer_ids` (KimiK3Model.capture_hidden_states); `write_context` projects every token of the step into
the draft layers' context caches, at the token's slot of the target's block table (the draft's caches are paged
like the target's MLA cache and share its blocks). The runner calls it inside its forward, so a step that replays
a target graph writes the context in that graph too. Then, for each request that samples and may speculate,
`propose` drafts K tokens from its newest token (the anchor). Tokens of rejected drafts leave cache rows past the
anchor; the next step's tokens overwrite them before any anchor reaches them.

With CUDA graphs, `propose` replays one graph per (padded request count, context bucket): the whole backbone,
lm_head and the left-to-right Markov loop, over persistent input buffers. Padding rows have no context (anchor
position 0) and draft garbage that nobody reads; rows never mix, so real rows are exact. A shape past the
captured ones (more requests than the largest decode graph, or a context bucket too large to capture) runs
eagerly.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from vllm.distributed.communication_op import tensor_model_parallel_all_gather
from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size
from vllm.model_executor.models.dspark.model import DSparkDraftModel
from vllm.model_executor.models.kimi_k3.model import KimiK3ForCausalLM

# Context buckets start here and double up to max_model_len: a draft step gathers its rows' whole context, so a
# bucket far above the longest context would waste the gather.
MIN_CONTEXT_BUCKET = 64
# Largest graph captured, in gathered context rows (requests x context bucket): bigger shapes run eagerly rather
# than hold their gather buffers in the graph pool for the engine's life.
MAX_GRAPH_CONTEXT_ROWS = 1 << 20


@dataclass(frozen=True, slots=True)
class DraftGraphKey:
    num_reqs: int
    max_context: int


def context_buckets(max_model_len: int) -> list[int]:
    """Powers of two from MIN_CONTEXT_BUCKET, then max_model_len itself, ascending."""
    out, c = [], MIN_CONTEXT_BUCKET
    while c < max_model_len:
        out.append(c)
        c *= 2
    return out + [max_model_len]


def whole_vocabulary(target: KimiK3ForCausalLM) -> tuple[nn.Module, torch.Tensor]:
    """The target's embedding and lm_head weight over the whole vocabulary, which the draft indexes directly (its
    mask token's row, its logits): the target's own, or under tensor parallelism a gathered copy per rank (the
    draft runs whole on every rank, so every rank drafts the same tokens)."""
    embed = target.model.embed_tokens
    head = embed.weight if target.config.tie_word_embeddings else target.lm_head.weight
    if get_tensor_model_parallel_world_size() == 1:
        return embed, head
    whole = tensor_model_parallel_all_gather(embed.weight, dim=0)
    head = whole if target.config.tie_word_embeddings else tensor_model_parallel_all_gather(head, dim=0)
    return nn.Embedding.from_pretrained(whole, freeze=True), head


class DSparkProposer:
    def __init__(self, draft: DSparkDraftModel, target: KimiK3ForCausalLM, num_speculative_tokens: int,
                 max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int, probabilistic: bool = False) -> None:
        self.draft, self.target, self.num_spec = draft, target, num_speculative_tokens
        self.probabilistic = probabilistic  # draft_sample_method "probabilistic": graphs sample at each row's T
        cfg = draft.config
        weight = target.model.embed_tokens.weight
        self.embed, self.lm_head = whole_vocabulary(target)
        self.context = torch.zeros(max_num_tokens, len(cfg.target_layer_ids) * target.config.hidden_size,
                                   dtype=weight.dtype, device=weight.device)
        target.model.capture_hidden_states(cfg.target_layer_ids, self.context)
        # The graphs' inputs, refilled in place before each replay.
        self.anchor_ids = torch.zeros(max_num_reqs, dtype=torch.int64, device=weight.device)
        self.anchor_pos = torch.zeros(max_num_reqs, dtype=torch.int64, device=weight.device)
        self.block_table = torch.zeros(max_num_reqs, max_blocks_per_req, dtype=torch.int32, device=weight.device)
        self.temperature = torch.zeros(max_num_reqs, dtype=torch.float32, device=weight.device)
        self.graphs = None  # the runner's CUDAGraphRunner once captured
        self.graph_keys: frozenset[DraftGraphKey] = frozenset()
        self.graph_reqs: list[int] = []
        self.graph_contexts: list[int] = []

    def allocate_caches(self, num_blocks: int, block_size: int) -> None:
        """The block manager's num_blocks, plus one block no table reaches: the padding rows' scratch."""
        cfg, weight = self.draft.config, self.target.model.embed_tokens.weight
        self.draft.bind_caches([torch.zeros(num_blocks + 1, block_size, cfg.mla_cache_dim, dtype=weight.dtype,
                                            device=weight.device) for _ in range(cfg.num_hidden_layers)])
        # Every position a block table reaches, and a draft block's K - 1 positions past the last one.
        self.draft.build_rope_table(self.block_table.shape[1] * block_size + self.num_spec, weight.device)

    def write_context(self, num_tokens: int, positions: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self.draft.write_context(self.context[:num_tokens], positions[:num_tokens], slot_mapping[:num_tokens])

    def graph_shapes(self, num_reqs: list[int], max_model_len: int) -> list[DraftGraphKey]:
        """The (request count, context bucket) graphs to capture for these request counts, largest first."""
        return sorted((DraftGraphKey(n, c) for n in set(num_reqs) if n <= self.anchor_ids.shape[0]
                       for c in context_buckets(max_model_len) if n * c <= MAX_GRAPH_CONTEXT_ROWS),
                      key=lambda k: (-k.num_reqs * k.max_context, -k.num_reqs))

    def graph_fn(self, key: DraftGraphKey):
        """What the graph for `key` records: a draft step over the persistent inputs, padded to its shape."""
        return functools.partial(self._propose_padded, key)

    def use_graphs(self, graphs, keys: list[DraftGraphKey]) -> None:
        """From now on `propose` replays `graphs` (the runner's CUDAGraphRunner) where one of `keys` fits."""
        self.graphs, self.graph_keys = graphs, frozenset(keys)
        self.graph_reqs = sorted({k.num_reqs for k in keys})
        self.graph_contexts = sorted({k.max_context for k in keys})

    def _graph_key(self, num_reqs: int, max_context: int) -> DraftGraphKey | None:
        n = next((s for s in self.graph_reqs if s >= num_reqs), None)
        c = next((s for s in self.graph_contexts if s >= max_context), None)
        key = DraftGraphKey(n, c)
        return key if key in self.graph_keys else None

    def _propose_padded(self, key: DraftGraphKey):
        n = key.num_reqs
        return self._run(self.anchor_ids[:n], self.anchor_pos[:n], self.block_table[:n], key.max_context, True,
                         self.temperature[:n] if self.probabilistic else None)

    def _run(self, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor, block_table: torch.Tensor, max_context: int,
             with_confidence: bool, temperature: torch.Tensor | None = None):
        return self.draft.propose(anchor_ids, anchor_pos, block_table, max_context, self.num_spec,
                                  self.embed, self.lm_head, with_confidence, temperature)

    def propose(self, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor, block_table: torch.Tensor,
                max_context: int, with_confidence: bool, temperature: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Drafts [N, K], confidences [N, K] when asked for (adaptive verification reads them), and with
        `temperature` [N] (probabilistic drafts; None: every row greedy) the draft distributions [N, K, V]. Request
        n's anchor anchor_ids[n] sits at anchor_pos[n] <= max_context (host) with its blocks in block_table[n]."""
        num_reqs = anchor_ids.shape[0]
        key = self._graph_key(num_reqs, max_context) if self.graphs is not None else None
        if key is None:
            return self._run(anchor_ids, anchor_pos, block_table, max_context, with_confidence, temperature)
        self.anchor_ids[:num_reqs].copy_(anchor_ids)
        self.anchor_pos[:num_reqs].copy_(anchor_pos)
        self.anchor_pos[num_reqs:key.num_reqs].zero_()  # padding rows attend to no context
        self.block_table[:num_reqs, :block_table.shape[1]].copy_(block_table)
        if self.probabilistic:
            self.temperature[:key.num_reqs].zero_()
            if temperature is not None:
                self.temperature[:num_reqs].copy_(temperature)
        drafts, confidence, probs = self.graphs.replay(key)
        return (drafts[:num_reqs], confidence[:num_reqs] if with_confidence and confidence is not None else None,
                probs[:num_reqs] if temperature is not None and probs is not None else None)
