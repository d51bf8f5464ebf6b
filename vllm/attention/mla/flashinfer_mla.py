"""FLASHINFER_MLA: FlashInfer's MLA kernels over the engine's paged latent cache [blocks, block_size, L+R],
on Blackwell (sm100/sm103) only.

Every row runs absorbed MQA in the latent space: q_nope is absorbed through W_UK (kv_b_proj's K half) and
concatenated with q_rope; the latent output [T, H, kv_lora_rank] goes back through W_UV. Two FlashInfer paths:

  * steps whose rows are all decodes (1..1+K tokens, ragged, as the seed's adaptive verification makes them):
    `flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla` with backend="trtllm-gen" (the kernel that takes
    ragged rows without an LSE), query [total_q, H, L+R], kv_cache as is (3-D), block_tables = the block
    table, seq_lens = KV lengths after this step, cum_seq_lens_q = the device query_start_loc (rows map to
    requests on the device; nothing is read on the host), max_q_len = common.max_query_len (the runner's
    promised bound, never re-measured), bmm1_scale = the softmax scale. Any decode batch, padding rows of
    zero length included, can therefore replay in a CUDA graph; causal masking within a request's rows is
    the kernel's (bottom-right aligned, as speculative verification needs).
  * steps with a prompt chunk: `flashinfer.mla.BatchMLAPagedAttentionWrapper`, planned once per step with
    causal=True over all rows (qo_indptr = query_start_loc, kv_indptr/kv_indices = the block table's rows at
    their uniform stride, kv_len_arr = seq_lens). plan() copies the offsets to the host, so these steps are
    never captured (they never are: batches with a prompt chunk run eagerly for KDA models).

New latent rows are written by TRITON_MLA's masked kernel: padding tokens (slot -1, every token of a graph
capture) write nothing. On sm90 this backend refuses: FlashInfer's Hopper MLA path (the JIT-compiled wrapper)
has never run in this engine, so `auto` takes TRITON_MLA there.

Facts from FlashInfer 0.7.2.post1's mla docstrings and docs.flashinfer.ai. Where it ran: no Blackwell GPU was
available, so no real kernel has run this glue; tests/attention/test_flashinfer_glue.py binds every call to the
installed library's real signatures on CPU and checks it against reference math.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from vllm.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionMetadataBuilder,
                                    CommonAttentionMetadata, LayerShapes, QueryLenSupport)

BLACKWELL = ((10, 0), (10, 3))
TRTLLM_PAGE_SIZES = (32, 64)
WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass(slots=True)
class FlashInferMLAMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor  # device int32 [B+1]
    seq_lens: torch.Tensor  # device int32 [B]: KV length after this step
    block_table: torch.Tensor  # device int32 [B, max_blocks], rows contiguous
    max_query_len: int
    max_seq_len: int
    page_size: int
    workspace: torch.Tensor | None  # trtllm-gen's zero-initialised workspace (trtllm steps)
    wrapper: Any = None  # BatchMLAPagedAttentionWrapper (wrapper steps), planned by the step's first layer
    planned: bool = False

    def plan_wrapper(self, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float,
                     dtype: torch.dtype) -> None:
        """Plans once per step: every MLA layer shares the heads, dims, scale and dtype."""
        if self.planned:
            return
        n, width = self.block_table.shape
        kv_indptr = torch.arange(n + 1, dtype=torch.int32, device=self.block_table.device) * width
        self.wrapper.plan(self.query_start_loc, kv_indptr, self.block_table.reshape(-1), self.seq_lens, num_heads,
                          kv_lora_rank, rope_dim, self.page_size, True, scale, dtype, dtype)
        self.planned = True


class FlashInferMLAMetadataBuilder(AttentionMetadataBuilder):
    query_len_support = QueryLenSupport.VARLEN

    # Decode steps of any row lengths read only device tensors. Steps with a prompt chunk plan on the host, but
    # the runner never captures those for KDA models (ModelRunner._cudagraph_mode).
    cudagraph_support = AttentionCGSupport.ALWAYS

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._workspace: torch.Tensor | None = None
        self._wrapper: Any = None

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return True  # decode steps take the device offsets; steps with a prompt chunk are never trimmed

    def build(self, common: CommonAttentionMetadata) -> FlashInferMLAMetadata:
        n = common.num_reqs
        device = common.block_table.device
        decode_only = not bool(common.is_prefilling[:n].any())
        meta = FlashInferMLAMetadata(
            num_tokens=common.num_actual_tokens, slot_mapping=common.slot_mapping[:common.num_actual_tokens],
            query_start_loc=common.query_start_loc[:n + 1], seq_lens=common.seq_lens[:n],
            block_table=common.block_table[:n], max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len, page_size=self.block_size, workspace=None)
        if decode_only:
            if self._workspace is None:
                self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            meta.workspace = self._workspace
        else:
            if self._wrapper is None:
                from flashinfer.mla import BatchMLAPagedAttentionWrapper
                self._wrapper = BatchMLAPagedAttentionWrapper(
                    torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device))
            meta.wrapper = self._wrapper
        return meta


class FlashInferMLABackend(AttentionBackend):
    name = "FLASHINFER_MLA"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, shapes: LayerShapes | None = None) -> str | None:
        try:
            mla = importlib.import_module("flashinfer.mla")
        except (ImportError, RuntimeError, OSError) as e:
            return f"flashinfer is not importable ({e}); pip install 'vllm[flashinfer]'"
        for fn in ("trtllm_batch_decode_with_kv_cache_mla", "BatchMLAPagedAttentionWrapper"):
            if not hasattr(mla, fn):
                return f"this flashinfer has no flashinfer.mla.{fn}"
        if device.type != "cuda":
            return f"needs a CUDA device (sm100/sm103), got {device}"
        try:
            importlib.import_module("vllm.attention.mla.triton_mla_kernels")
        except ImportError as e:
            return f"writes the latent cache with Triton, which is not importable ({e})"
        cap = tuple(torch.cuda.get_device_capability(device))
        if cap not in BLACKWELL:
            return (f"its trtllm-gen ragged decode needs sm100/sm103 (Blackwell), this device is sm{cap[0]}{cap[1]}; "
                    "FlashInfer's other MLA paths have not run in this engine (use TRITON_MLA)")
        if "cum_seq_lens_q" not in inspect.signature(mla.trtllm_batch_decode_with_kv_cache_mla).parameters:
            return ("ragged decode needs a trtllm_batch_decode_with_kv_cache_mla that takes cum_seq_lens_q "
                    "(a newer flashinfer-python)")
        if dtype != torch.bfloat16:
            return f"takes bf16 queries and cache only, the model runs in {dtype}"
        if shapes is None:
            return None
        if (shapes.kv_lora_rank, shapes.qk_rope_head_dim) != (512, 64):
            return (f"trtllm-gen MLA needs kv_lora_rank 512 and qk_rope_head_dim 64, the model has "
                    f"{shapes.kv_lora_rank} and {shapes.qk_rope_head_dim}")
        if shapes.block_size not in TRTLLM_PAGE_SIZES:
            return f"trtllm-gen MLA needs block size 32 or 64, the cache uses {shapes.block_size}"
        return None

    @classmethod
    def builder(cls, block_size: int) -> FlashInferMLAMetadataBuilder:
        return FlashInferMLAMetadataBuilder(block_size)

    @staticmethod
    def forward(q: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor, kv_b_weight: torch.Tensor,
                qk_nope_head_dim: int, v_head_dim: int, scale: float, meta: FlashInferMLAMetadata) -> torch.Tensor:
        """q [T, H, nope+rope]; latent [T, L+R]; kv_cache [blocks, bs, L+R]. Returns o [T, H, v_head_dim]."""
        from vllm.attention.mla.triton_mla_kernels import write_latent
        write_latent(latent, kv_cache, meta.slot_mapping)
        T, H, L = meta.num_tokens, q.shape[1], kv_b_weight.shape[1]
        R = kv_cache.shape[-1] - L
        w = kv_b_weight.view(H, qk_nope_head_dim + v_head_dim, L)
        q_nope = torch.bmm(q[:T, :, :qk_nope_head_dim].transpose(0, 1), w[:, :qk_nope_head_dim]).transpose(0, 1)
        q_rope = q[:T, :, qk_nope_head_dim:]
        if meta.wrapper is None:
            from flashinfer.mla import trtllm_batch_decode_with_kv_cache_mla
            o_latent = trtllm_batch_decode_with_kv_cache_mla(
                query=torch.cat([q_nope, q_rope], dim=-1), kv_cache=kv_cache, workspace_buffer=meta.workspace,
                qk_nope_head_dim=qk_nope_head_dim, kv_lora_rank=L, qk_rope_head_dim=R,
                block_tables=meta.block_table, seq_lens=meta.seq_lens, max_seq_len=meta.max_seq_len,
                bmm1_scale=scale, bmm2_scale=1.0, backend="trtllm-gen", cum_seq_lens_q=meta.query_start_loc,
                max_q_len=meta.max_query_len)
        else:
            meta.plan_wrapper(H, L, R, scale, q.dtype)
            o_latent = meta.wrapper.run(q_nope.contiguous(), q_rope.contiguous(), kv_cache[..., :L],
                                        kv_cache[..., L:])
        o = q.new_zeros(q.shape[0], H, v_head_dim)
        o[:T] = torch.bmm(o_latent.transpose(0, 1), w[:, qk_nope_head_dim:].transpose(1, 2)).transpose(0, 1)
        return o

