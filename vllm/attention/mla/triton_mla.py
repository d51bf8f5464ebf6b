"""TRITON_MLA: absorbed MLA over the paged latent cache with Triton split-KV kernels.

Every row of the step, decode (1..K+1 tokens) or prompt chunk (with or without cached context), takes the
same path: the new latent rows are written into the cache, q_nope is absorbed through W_UK (a bmm), one
Triton kernel runs causal latent-space MQA split across the context, a second merges the splits, and W_UV
projects the latent output back (a bmm). Per-request lengths are read on the device from
`query_start_loc` and `seq_lens`; the host only supplies the bounds that size the grid, so the builder
never syncs and one captured grid replays for any lengths within those bounds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionMetadataBuilder,
                                    CommonAttentionMetadata, LayerShapes, QueryLenSupport)

try:
    from vllm.attention.mla import triton_mla_kernels as _kernels
    _IMPORT_ERROR = None
except ImportError as e:  # supports() reports it; nothing else here runs without triton
    _kernels, _IMPORT_ERROR = None, e

# Split sizing: enough programs to give every SM about two, but each split at least _MIN_SPLIT_LEN context
# positions: a split writes and the merge reads back fp32 partials of H x L per token, which at 16..64
# heads stays near a tenth of the split's cache reads at 512 positions. A starting point to tune on GPU.
_PROGRAMS_PER_SM = 2
_MIN_SPLIT_LEN = 512
_MAX_SPLITS = 128  # 128K positions at 1K a split: about one program per SM for a lone request
_DEFAULT_NUM_SMS = 132  # H100/H200, when no GPU is visible (the interpreter)


@dataclass(slots=True)
class TritonMLAMetadata:
    query_start_loc: torch.Tensor  # device int32 [B+1]
    seq_lens: torch.Tensor  # device int32 [B]
    block_table: torch.Tensor  # device int32 [B, max_blocks]
    slot_mapping: torch.Tensor  # device int64 [num_actual_tokens], -1 for padding
    num_reqs: int
    max_query_len: int  # bound on every row's query length: sizes the grid
    num_splits: int
    block_size: int


class TritonMLAMetadataBuilder(AttentionMetadataBuilder):
    cudagraph_support = AttentionCGSupport.ALWAYS
    query_len_support = QueryLenSupport.VARLEN

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return True  # the kernels read query lengths from the device offsets only

    def __init__(self, block_size: int, num_splits: int | None = None) -> None:
        self.block_size = block_size
        self.num_splits = num_splits  # None: pick per step from the batch shape
        self.num_sms = (torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
                        if torch.cuda.is_available() else _DEFAULT_NUM_SMS)

    def build(self, common: CommonAttentionMetadata) -> TritonMLAMetadata:
        n = common.num_reqs
        return TritonMLAMetadata(
            query_start_loc=common.query_start_loc[:n + 1], seq_lens=common.seq_lens[:n],
            block_table=common.block_table[:n], slot_mapping=common.slot_mapping[:common.num_actual_tokens],
            num_reqs=n, max_query_len=common.max_query_len,
            num_splits=self.num_splits or self._auto_splits(n, common.max_query_len, common.max_seq_len),
            block_size=self.block_size)

    def _auto_splits(self, num_reqs: int, max_query_len: int, max_seq_len: int) -> int:
        # The builder does not know H, so it counts one row block per query token: exact for one-token
        # decode at H <= 64, an over-count (fewer splits) when few heads let tokens share a block. Prompt
        # chunks bring many row blocks and get no split. Powers of two bound the merge kernel's variants.
        row_blocks = max(1, num_reqs * max_query_len)
        want = min(-(-self.num_sms * _PROGRAMS_PER_SM // row_blocks), -(-max_seq_len // _MIN_SPLIT_LEN),
                   _MAX_SPLITS)
        return 1 << (max(1, want) - 1).bit_length()


class TritonMLABackend(AttentionBackend):
    name = "TRITON_MLA"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, shapes: LayerShapes | None = None) -> str | None:
        if _kernels is None:
            return f"needs an importable triton ({_IMPORT_ERROR})"
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"needs a float32, bfloat16 or float16 model dtype (dtype is {dtype})"
        device = torch.device(device)
        # The Triton interpreter also runs the kernels on CPU tensors, but only as a test vehicle: far too
        # slow to serve, so a CPU is refused even with TRITON_INTERPRET=1.
        if device.type != "cuda" or not torch.cuda.is_available():
            return f"needs a CUDA GPU (device is {device}, CUDA available: {torch.cuda.is_available()})"
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            return (f"needs a CUDA GPU of compute capability >= 8.0 (device is "
                    f"{torch.cuda.get_device_name(device)}, sm_{major}{minor})")
        return None

    @classmethod
    def builder(cls, block_size: int, num_splits: int | None = None) -> TritonMLAMetadataBuilder:
        return TritonMLAMetadataBuilder(block_size, num_splits)

    @staticmethod
    def forward(q: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor, kv_b_weight: torch.Tensor,
                qk_nope_head_dim: int, v_head_dim: int, scale: float, meta: TritonMLAMetadata) -> torch.Tensor:
        """q [T, H, nope+rope]; latent [T, L+R] the new tokens' normalised rows; kv_cache [blocks, bs, L+R].

        kv_b_weight [H*(nope+v), L] is kv_b_proj's weight. Returns o [T, H, v_head_dim].
        """
        assert kv_cache.shape[1] == meta.block_size, "cache blocks differ from the builder's block_size"
        _kernels.write_latent(latent, kv_cache, meta.slot_mapping)
        T, H, _ = q.shape
        L = kv_b_weight.shape[1]
        w = kv_b_weight.to(q.dtype).view(H, qk_nope_head_dim + v_head_dim, L)
        w_uk, w_uv = w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]
        # Absorb W_UK into the query so scores read the latent cache directly: q_lat[h, t] = q_nope[t, h] W_UK[h].
        q_lat = torch.bmm(q[..., :qk_nope_head_dim].transpose(0, 1), w_uk)
        o_lat = _kernels.latent_attention(q_lat, q[..., qk_nope_head_dim:], kv_cache, meta.query_start_loc,
                                          meta.seq_lens, meta.block_table, meta.num_reqs, meta.max_query_len,
                                          meta.num_splits, scale)
        out = q.new_empty(T, H, v_head_dim)
        torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2), out=out.transpose(0, 1))
        return out
