"""DSparkProposer: the DSpark draft inside the model runner, on the runner's device.

Each step the target's forward fills a persistent buffer with its hidden states at the draft's
`target_layer_ids` (KimiK3Model.capture_hidden_states); `write_context` projects every token of the step into
the draft layers' context caches, at the token's slot of the target's block table (the draft's caches are paged
like the target's MLA cache and share its blocks). Then, for each request that samples and may speculate,
`propose` drafts K tokens from its newest token (the anchor). Tokens of rejected drafts leave cache rows past the
anchor; the next step's tokens overwrite them before any anchor reaches them.
"""
from __future__ import annotations

import torch

from vllm.model_executor.models.dspark.model import DSparkDraftModel
from vllm.model_executor.models.kimi_k3.model import KimiK3ForCausalLM


class DSparkProposer:
    def __init__(self, draft: DSparkDraftModel, target: KimiK3ForCausalLM, num_speculative_tokens: int,
                 max_num_tokens: int) -> None:
        self.draft, self.target, self.num_spec = draft, target, num_speculative_tokens
        cfg = draft.config
        weight = target.model.embed_tokens.weight
        self.context = torch.zeros(max_num_tokens, len(cfg.target_layer_ids) * target.config.hidden_size,
                                   dtype=weight.dtype, device=weight.device)
        target.model.capture_hidden_states(cfg.target_layer_ids, self.context)

    def allocate_caches(self, num_blocks: int, block_size: int) -> None:
        """The block manager's num_blocks, plus one block no table reaches: the padding rows' scratch."""
        cfg, weight = self.draft.config, self.target.model.embed_tokens.weight
        self.draft.bind_caches([torch.zeros(num_blocks + 1, block_size, cfg.mla_cache_dim, dtype=weight.dtype,
                                            device=weight.device) for _ in range(cfg.num_hidden_layers)])

    def write_context(self, num_tokens: int, positions: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self.draft.write_context(self.context[:num_tokens], positions[:num_tokens], slot_mapping[:num_tokens])

    def propose(self, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor, block_table: torch.Tensor,
                max_context: int, with_confidence: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts [N, K] and, when asked for (adaptive verification reads them), confidences [N, K]."""
        target = self.target
        lm_head = target.model.embed_tokens.weight if target.config.tie_word_embeddings else target.lm_head.weight
        return self.draft.propose(anchor_ids, anchor_pos, block_table, max_context, self.num_spec,
                                  target.model.embed_tokens, lm_head, with_confidence)

