"""The torch reference MLA backend over a paged latent cache.

Each token caches one latent row [c_kv (kv_lora_rank) | k_r (qk_rope_head_dim)]. Prompt-chunk rows run
unabsorbed (K and V expanded through kv_b_proj); decode and verify rows run absorbed MQA in the latent
space. Both are the same math; tests force either form to check that. One-token decode rows run as one
batched, padded MQA over all of them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionMetadataBuilder,
                                    CommonAttentionMetadata, QueryLenSupport)


@dataclass(slots=True)
class TorchMLAMetadata:
    query_start_loc: list[int]
    is_prefilling: list[bool]
    seq_lens: list[int]
    context_rows: torch.Tensor  # [B, max_seq_len]: request r's cache rows of positions 0..seq_lens[r]-1
    slot_mapping: torch.Tensor
    force_absorbed: bool | None = None  # tests: None picks by row kind
    # One-token decode rows, batched: token index [N], padded context rows [N, S] and their validity [N, S].
    decode_token_idx: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    decode_valid: torch.Tensor | None = None
    decode_rows: frozenset[int] = frozenset()


class TorchMLAMetadataBuilder(AttentionMetadataBuilder):
    cudagraph_support = AttentionCGSupport.NEVER
    query_len_support = QueryLenSupport.VARLEN

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def build(self, common: CommonAttentionMetadata) -> TorchMLAMetadata:
        n = common.num_reqs
        # The device lengths are the exact ones (the host's are an upper bound: under async scheduling a row after
        # a verify step in flight is placed as if all its drafts were accepted). A reference may read them.
        seq_lens_t = common.seq_lens[:n].cpu()
        seq_lens = seq_lens_t.tolist()
        max_len = max(seq_lens, default=0)
        pos = torch.arange(max_len, device=common.block_table.device)
        blocks = common.block_table[:n, :-(-max_len // self.block_size)].long()
        rows = blocks[:, pos // self.block_size] * self.block_size + pos % self.block_size  # [n, max_len]
        meta = TorchMLAMetadata(
            query_start_loc=common.query_start_loc_cpu[:n + 1].tolist(),
            is_prefilling=common.is_prefilling[:n].tolist(),
            seq_lens=seq_lens,
            context_rows=rows,
            slot_mapping=common.slot_mapping[:common.num_actual_tokens],
        )
        decode = common.single_token_decode_rows()
        if len(decode):
            dev = rows.device
            lens = seq_lens_t[decode]
            S = int(lens.max())
            meta.decode_token_idx = common.query_start_loc_cpu[decode].long().to(dev)
            meta.decode_slots = rows[decode.to(dev), :S]
            meta.decode_valid = pos[None, :S] < lens.to(dev)[:, None]
            meta.decode_rows = frozenset(decode.tolist())
        return meta


class TorchMLABackend(AttentionBackend):
    name = "TORCH_MLA"

    @classmethod
    def builder(cls, block_size: int) -> TorchMLAMetadataBuilder:
        return TorchMLAMetadataBuilder(block_size)

    @staticmethod
    def forward(q: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor, kv_b_weight: torch.Tensor,
                qk_nope_head_dim: int, v_head_dim: int, scale: float, meta: TorchMLAMetadata) -> torch.Tensor:
        """q [T, H, nope+rope]; latent [T, L+R] the new tokens' normalised rows; kv_cache [blocks, bs, L+R].

        kv_b_weight [H*(nope+v), L] is kv_b_proj's weight. Returns o [T, H, v_head_dim].
        """
        rows = kv_cache.view(-1, kv_cache.shape[-1])
        valid = meta.slot_mapping >= 0
        rows[meta.slot_mapping[valid]] = latent[:meta.slot_mapping.shape[0]][valid].to(rows.dtype)
        L = kv_b_weight.shape[1]
        H = q.shape[1]
        w = kv_b_weight.float().view(H, qk_nope_head_dim + v_head_dim, L)
        w_uk, w_uv = w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]
        out = q.new_empty(q.shape[0], H, v_head_dim, dtype=torch.float32)
        if meta.decode_token_idx is not None and meta.force_absorbed is not False:
            idx = meta.decode_token_idx
            ctx = rows[meta.decode_slots].float()  # [N, S, L+R], padding masked below
            c_kv, k_r = ctx[..., :L], ctx[..., L:]
            ql = torch.einsum("nhd,hdl->nhl", q[idx, :, :qk_nope_head_dim].float(), w_uk)
            scores = torch.einsum("nhl,nsl->nhs", ql, c_kv) + torch.einsum(
                "nhr,nsr->nhs", q[idx, :, qk_nope_head_dim:].float(), k_r)
            p = (scores * scale).masked_fill(~meta.decode_valid[:, None, :], float("-inf")).softmax(-1)
            out[idx] = torch.einsum("nhl,hvl->nhv", torch.einsum("nhs,nsl->nhl", p, c_kv), w_uv)
        batched = meta.decode_rows if meta.force_absorbed is not False else frozenset()
        qsl = meta.query_start_loc
        for r, seq_len in enumerate(meta.seq_lens):
            s, e = qsl[r], qsl[r + 1]
            if e == s or r in batched:
                continue
            ctx = rows[meta.context_rows[r, :seq_len]].float()
            c_kv, k_r = ctx[:, :L], ctx[:, L:]
            q_n, q_r = q[s:e, :, :qk_nope_head_dim].float(), q[s:e, :, qk_nope_head_dim:].float()
            S, T = ctx.shape[0], e - s
            causal = torch.arange(S, device=q.device)[None, :] <= (S - T + torch.arange(T, device=q.device))[:, None]
            absorbed = not meta.is_prefilling[r] if meta.force_absorbed is None else meta.force_absorbed
            if absorbed:
                ql = torch.einsum("thn,hnl->thl", q_n, w_uk)
                scores = torch.einsum("thl,sl->hts", ql, c_kv) + torch.einsum("thr,sr->hts", q_r, k_r)
                p = (scores * scale).masked_fill(~causal, float("-inf")).softmax(-1)
                out[s:e] = torch.einsum("hts,sl,hvl->thv", p, c_kv, w_uv)
            else:
                k_n = torch.einsum("sl,hnl->shn", c_kv, w_uk)
                v = torch.einsum("sl,hvl->shv", c_kv, w_uv)
                scores = torch.einsum("thn,shn->hts", q_n, k_n) + torch.einsum("thr,sr->hts", q_r, k_r)
                p = (scores * scale).masked_fill(~causal, float("-inf")).softmax(-1)
                out[s:e] = torch.einsum("hts,shv->thv", p, v)
        return out.to(q.dtype)
