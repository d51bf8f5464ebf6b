"""Runs whole sequences through the model in the engine's batch shape, without the engine.

Each sequence owns a KDA state slot and MLA cache blocks; `step` runs any mix of prompt chunks and decode
tokens of many sequences as one flat batch with a CommonAttentionMetadata, exactly as the engine will.
It tests the model on its own, without the scheduler: incremental vs whole, mixed batches, the oracles.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm.attention.backend import CommonAttentionMetadata, HybridAttentionMetadata
from vllm.model_executor.models.kimi_k3.model import KimiK3ForCausalLM, allocate_layer_caches


@dataclass(slots=True)
class SeqSlot:
    slot: int
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0


@dataclass(slots=True)
class SeqChunk:
    """New tokens of one sequence for one step; `prefill` marks a prompt chunk (request state)."""
    seq_id: int
    token_ids: list[int]
    prefill: bool


class SequenceRunner:
    def __init__(self, model: KimiK3ForCausalLM, max_seqs: int = 8, max_model_len: int = 512,
                 block_size: int = 16, state_dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        torch.set_flush_denormal(True)  # as the engine's runner does: CPU denormals are ~100x slower
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        p = next(model.parameters())
        self.device = p.device
        act_dtype = model.model.embed_tokens.weight.dtype
        self.caches = allocate_layer_caches(model.config, max_seqs * self.max_blocks, block_size, max_seqs,
                                            act_dtype, state_dtype, self.device)
        model.bind_caches(self.caches)
        cfg, backends = model.config, model.backends
        self.kda_builder = backends.kda.builder(block_size) if cfg.kda_layers else None
        self.mla_builder = backends.mla.builder(block_size) if cfg.mla_layers else None
        # Scatter the slots and blocks so tests exercise real indirection, not identity maps.
        self.free_slots = list(range(max_seqs))[::-1]
        self.free_blocks = list(range(max_seqs * self.max_blocks))[::-1]
        self.seqs: dict[int, SeqSlot] = {}

    def add(self, seq_id: int) -> None:
        self.seqs[seq_id] = SeqSlot(slot=self.free_slots.pop())

    def free(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id)
        self.free_slots.append(seq.slot)
        self.free_blocks.extend(seq.blocks)

    def metadata(self, chunks: list[SeqChunk]) -> CommonAttentionMetadata:
        lens = [len(c.token_ids) for c in chunks]
        seq_lens, slot_mapping = [], []
        block_table = torch.zeros(len(chunks), self.max_blocks, dtype=torch.int32)
        for r, c in enumerate(chunks):
            seq = self.seqs[c.seq_id]
            total = seq.num_computed + len(c.token_ids)
            while len(seq.blocks) * self.block_size < total:
                seq.blocks.append(self.free_blocks.pop())
            block_table[r, :len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
            slot_mapping += [seq.blocks[p // self.block_size] * self.block_size + p % self.block_size
                             for p in range(seq.num_computed, total)]
            seq_lens.append(total)
        qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        state_indices = torch.tensor([self.seqs[c.seq_id].slot for c in chunks], dtype=torch.int32)
        dev = self.device
        return CommonAttentionMetadata(
            query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
            num_reqs=len(chunks), num_actual_tokens=sum(lens), max_query_len=max(lens),
            max_seq_len=max(seq_lens), block_table=block_table.to(dev),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=dev),
            is_prefilling=torch.tensor([c.prefill for c in chunks]),
            state_indices=state_indices.to(dev), state_indices_cpu=state_indices)

    @torch.inference_mode()
    def step(self, chunks: list[SeqChunk], all_logits: bool = False) -> list[torch.Tensor]:
        """Runs one flat batch; returns per chunk the logits of its last token [V] (or all its tokens [n, V])."""
        common = self.metadata(chunks)
        attn = HybridAttentionMetadata(kda=self.kda_builder.build(common) if self.kda_builder else None,
                                       mla=self.mla_builder.build(common) if self.mla_builder else None)
        ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(self.seqs[c.seq_id].num_computed,
                                            self.seqs[c.seq_id].num_computed + len(c.token_ids))
                               for c in chunks]).to(self.device)
        hidden = self.model(ids, positions, attn)
        ends = common.query_start_loc_cpu[1:].tolist()
        starts = common.query_start_loc_cpu[:-1].tolist()
        for c in chunks:
            self.seqs[c.seq_id].num_computed += len(c.token_ids)
        if all_logits:
            logits = self.model.compute_logits(hidden)
            return [logits[s:e] for s, e in zip(starts, ends)]
        return list(self.model.compute_logits(hidden[[e - 1 for e in ends]]))

    def forward_whole(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [n, V] of one sequence run as a single prompt chunk."""
        seq_id = -1
        self.add(seq_id)
        try:
            return self.step([SeqChunk(seq_id, token_ids, prefill=True)], all_logits=True)[0]
        finally:
            self.free(seq_id)

    def generate_greedy(self, prompts: list[list[int]], max_tokens: int, prefill_chunk: int | None = None,
                        stop_ids: tuple[int, ...] = ()) -> list[list[int]]:
        """Greedy continuation of all prompts batched together (prompts chunked to `prefill_chunk` tokens)."""
        for i in range(len(prompts)):
            self.add(i)
        prompt_left = {i: list(p) for i, p in enumerate(prompts)}
        outputs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        try:
            while prompt_left:
                chunks = []
                for i, left in prompt_left.items():
                    if outputs[i]:  # decoding: feed the last sampled token
                        chunks.append(SeqChunk(i, outputs[i][-1:], prefill=False))
                    else:
                        n = len(left) if prefill_chunk is None else min(prefill_chunk, len(left))
                        chunks.append(SeqChunk(i, left[:n], prefill=True))
                        prompt_left[i] = left[n:]
                for c, row in zip(chunks, self.step(chunks)):
                    if c.prefill and prompt_left[c.seq_id]:
                        continue  # mid-prompt: nothing to sample yet
                    out = outputs[c.seq_id]
                    out.append(int(row.argmax()))
                    if len(out) >= max_tokens or out[-1] in stop_ids:
                        del prompt_left[c.seq_id]
        finally:
            for i in range(len(prompts)):
                self.free(i)
        return [outputs[i] for i in range(len(prompts))]
