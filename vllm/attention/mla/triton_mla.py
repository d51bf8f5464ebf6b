"""TRITON_MLA: absorbed MLA over the paged latent cache with Triton split-KV kernels.

Decode and verify rows (1..K+1 tokens) and short prompt chunks take the absorbed path: the new latent rows
are written into the cache, q_nope is absorbed through W_UK (a bmm), one Triton kernel runs causal
latent-space MQA split across the context, a second merges the splits, and W_UV projects the latent output
back (a bmm). Per-request lengths are read on the device from `query_start_loc` and `seq_lens`; the host
only supplies the bounds that size the grid, so the builder never syncs and one captured grid replays for
any lengths within those bounds.

Prompt chunks longer than `prefill_min_query_len` tokens run unabsorbed, as upstream's MLA prefill does: the
request's latent rows are decompressed through kv_b_proj into per-head K and V, and flash attention (torch
SDPA) runs causally over them. Absorbed attention spends (L + R) + L = 1088 multiply-adds per score and head
against (nope + R) + v = 320 unabsorbed, and its latent-width tiles run far below tensor peak: at a 32K
prompt of the 1.3B config it was 230 of 318 ms of GPU time. A step's chunks run together: one gather and
GEMM decompress their contexts, one varlen flash attention covers them (`unabsorbed_varlen`). This path
reads host row lengths, so it is planned only outside graph capture (prompt chunks run eagerly under
FULL_DECODE_ONLY); a captured graph keeps every row absorbed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from vllm.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionMetadataBuilder,
                                    CommonAttentionMetadata, LayerShapes, QueryLenSupport)
from vllm.utils import async_tensor_h2d, async_tensors_h2d

try:
    from vllm.attention.mla import triton_mla_kernels as _kernels
    _IMPORT_ERROR = None
except ImportError as e:  # supports() reports it; nothing else here runs without triton
    _kernels, _IMPORT_ERROR = None, e

# Prompt chunks longer than this run unabsorbed (module docstring). Verify rows never do: they are not prompts.
PREFILL_MIN_QUERY_LEN = 16
# Never the math backend on a GPU: it would materialise [H, q, context] scores (32 GiB at a 32K prompt). The
# memory-efficient kernel takes qk and v head dims that differ (192 / 128), in multiples of 8.
_FLASH_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
_HEAD_DIM_ALIGN = 8


@dataclass(frozen=True, slots=True)
class PrefillRow:
    """A prompt chunk that runs unabsorbed: request `req`'s tokens [q_start, q_end) over seq_len positions."""
    req: int
    q_start: int
    q_end: int
    seq_len: int


@dataclass(frozen=True, slots=True)
class VarlenPlan:
    """Where a step's unabsorbed chunks read and write, the same for every MLA layer (built once per step):
    the chunks' token positions in the step, their contexts' cache slots, and the offsets of both."""
    q_index: torch.Tensor  # device int64 [sum of chunk lengths]
    slots: torch.Tensor  # device int64 [sum of seq_lens]: the rows' latent cache slots, position by position
    cu_q: torch.Tensor  # device int32 [rows + 1]
    cu_k: torch.Tensor  # device int32 [rows + 1]
    max_q: int
    max_k: int


@dataclass(slots=True)
class TritonMLAMetadata:
    query_start_loc: torch.Tensor  # device int32 [B+1]
    seq_lens: torch.Tensor  # device int32 [B]
    block_table: torch.Tensor  # device int32 [B, max_blocks]
    slot_mapping: torch.Tensor  # device int64 [num_actual_tokens], -1 for padding
    num_reqs: int
    max_query_len: int  # bound on the query length of every absorbed row: sizes the grid; 0: no absorbed row
    max_seq_len: int  # bound on every row's sequence length: sizes the context splits
    num_splits: int | None  # None: the kernel picks them from the bounds and the head count
    block_size: int
    prefill_rows: tuple[PrefillRow, ...] = ()
    skip_reqs: torch.Tensor | None = None  # device int8 [B]: 1 for the requests of prefill_rows
    varlen: VarlenPlan | None = None  # with two or more prefill rows


class TritonMLAMetadataBuilder(AttentionMetadataBuilder):
    cudagraph_support = AttentionCGSupport.ALWAYS
    query_len_support = QueryLenSupport.VARLEN

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return True  # the kernels read query lengths from the device offsets only

    def __init__(self, block_size: int, num_splits: int | None = None,
                 prefill_min_query_len: int = PREFILL_MIN_QUERY_LEN) -> None:
        self.block_size = block_size
        self.num_splits = num_splits  # None: the kernel picks them per step (triton_mla_kernels.auto_num_splits)
        self.prefill_min_query_len = prefill_min_query_len

    def build(self, common: CommonAttentionMetadata) -> TritonMLAMetadata:
        return self._build(common, self._prefill_rows(common))

    def build_for_capture(self, common: CommonAttentionMetadata) -> TritonMLAMetadata:
        return self._build(common, ())  # a replayed step has no prompt chunk: every row absorbed

    def _build(self, common: CommonAttentionMetadata, prefill: tuple[PrefillRow, ...]) -> TritonMLAMetadata:
        n = common.num_reqs
        max_query_len, skip, varlen = common.max_query_len, None, None
        if prefill:
            # Device row lengths never exceed the host ones (device trims only shorten drafts), so the host
            # lengths of the other rows bound the absorbed grid.
            planned = {row.req for row in prefill}
            lens = common.query_lens_cpu[:n].tolist()
            max_query_len = max((q for r, q in enumerate(lens) if r not in planned), default=0)
            skip, varlen = self._upload_prefill(common, prefill, np.array([r in planned for r in range(n)]))
        return TritonMLAMetadata(
            query_start_loc=common.query_start_loc[:n + 1], seq_lens=common.seq_lens[:n],
            block_table=common.block_table[:n], slot_mapping=common.slot_mapping[:common.num_actual_tokens],
            num_reqs=n, max_query_len=max_query_len, max_seq_len=common.max_seq_len,
            num_splits=1 if prefill else self.num_splits, block_size=self.block_size,
            prefill_rows=prefill, skip_reqs=skip, varlen=varlen)

    def _upload_prefill(self, common: CommonAttentionMetadata, prefill: tuple[PrefillRow, ...],
                        skip: np.ndarray) -> tuple[torch.Tensor, VarlenPlan | None]:
        """The skip flags and, for two or more chunks, their varlen plan, in one queued upload (host-built: the
        chunks' bounds are host ints)."""
        device = common.query_start_loc.device
        if len(prefill) < 2:
            return async_tensor_h2d(skip, torch.int8, device), None
        q_lens = [r.q_end - r.q_start for r in prefill]
        seq_lens = [r.seq_len for r in prefill]
        q_index = np.concatenate([np.arange(r.q_start, r.q_end) for r in prefill])
        req = np.repeat([r.req for r in prefill], seq_lens)
        pos = np.concatenate([np.arange(k) for k in seq_lens])
        cu = np.concatenate([np.cumsum([0] + q_lens), np.cumsum([0] + seq_lens)])
        skip_d, q_index, req, pos, cu = async_tensors_h2d([skip, q_index, req, pos, cu], device)
        cu_q, cu_k = cu.int().split(len(prefill) + 1)
        slots = common.block_table[req, pos // self.block_size].long() * self.block_size + pos % self.block_size
        return skip_d.to(torch.int8), VarlenPlan(q_index, slots, cu_q, cu_k, max(q_lens), max(seq_lens))

    def _prefill_rows(self, common: CommonAttentionMetadata) -> tuple[PrefillRow, ...]:
        if common.max_query_len <= self.prefill_min_query_len:  # decode steps: no tensor work on the host
            return ()
        n = common.num_reqs
        qsl = common.query_start_loc_cpu
        long = common.is_prefilling[:n] & (qsl[1:n + 1] - qsl[:n] > self.prefill_min_query_len)
        if not bool(long.any()):
            return ()
        return tuple(PrefillRow(r, int(qsl[r]), int(qsl[r + 1]), int(common.seq_lens_cpu[r]))
                     for r in long.nonzero().flatten().tolist())


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
    def builder(cls, block_size: int, num_splits: int | None = None,
                prefill_min_query_len: int = PREFILL_MIN_QUERY_LEN) -> TritonMLAMetadataBuilder:
        return TritonMLAMetadataBuilder(block_size, num_splits, prefill_min_query_len)

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
        out = q.new_empty(T, H, v_head_dim)
        if meta.max_query_len:
            w = kv_b_weight.to(q.dtype).view(H, qk_nope_head_dim + v_head_dim, L)
            w_uk, w_uv = w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]
            # Absorb W_UK into the query so scores read the latent cache directly: q_lat[h, t] = q_nope[t, h] W_UK[h].
            q_lat = torch.bmm(q[..., :qk_nope_head_dim].transpose(0, 1), w_uk)
            o_lat = _kernels.latent_attention(q_lat, q[..., qk_nope_head_dim:], kv_cache, meta.query_start_loc,
                                              meta.seq_lens, meta.block_table, meta.num_reqs, meta.max_query_len,
                                              meta.max_seq_len, scale, meta.num_splits, meta.skip_reqs)
            torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2), out=out.transpose(0, 1))
        if meta.varlen is not None and _varlen_flash_fits(q, v_head_dim):
            unabsorbed_varlen(q, kv_cache, meta.varlen, kv_b_weight, qk_nope_head_dim, v_head_dim, scale, out)
        else:
            for row in meta.prefill_rows:
                out[row.q_start:row.q_end] = unabsorbed_attention(
                    q[row.q_start:row.q_end], kv_cache, meta.block_table[row.req], row.seq_len, kv_b_weight,
                    qk_nope_head_dim, v_head_dim, scale)
        return out


def _varlen_flash_fits(q: torch.Tensor, v_head_dim: int) -> bool:
    """FlashAttention-2's varlen kernel (inside torch) takes this step: half precision on a GPU, q/k head dims
    a multiple of 8 up to 256, v no wider than q (padded to it)."""
    d = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d % _HEAD_DIM_ALIGN == 0 and d <= 256
            and v_head_dim <= d and hasattr(torch.ops.aten, "_flash_attention_forward"))


def unabsorbed_varlen(q: torch.Tensor, kv_cache: torch.Tensor, plan: VarlenPlan, kv_b_weight: torch.Tensor,
                      qk_nope_head_dim: int, v_head_dim: int, scale: float, out: torch.Tensor) -> None:
    """Every unabsorbed prompt chunk of the step at once (as unabsorbed_attention does one): the rows' latent
    contexts gathered and decompressed in one GEMM, one varlen flash attention over them, causal aligned to
    the lower right per row. A loop over rows launched ~20 kernels per chunk and layer: a wave of 32 prompts
    spent more host time there than the GPU needed for the whole step. Writes the rows' outputs into `out`."""
    H, d = q.shape[1], q.shape[2]
    L, nk = kv_b_weight.shape[1], len(plan.slots)
    lat = kv_cache.view(-1, kv_cache.shape[-1])[plan.slots]
    kv = (lat[:, :L].to(q.dtype) @ kv_b_weight.to(q.dtype).t()).view(nk, H, qk_nope_head_dim + v_head_dim)
    k = torch.cat([kv[..., :qk_nope_head_dim], lat[:, None, L:].to(q.dtype).expand(nk, H, -1)], dim=-1)
    v = torch.nn.functional.pad(kv[..., qk_nope_head_dim:], (0, d - v_head_dim))
    o = torch.ops.aten._flash_attention_forward(q[plan.q_index], k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k,
                                                0.0, True, False, scale=scale)[0]
    out[plan.q_index] = o[..., :v_head_dim]


def unabsorbed_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_row: torch.Tensor, seq_len: int,
                         kv_b_weight: torch.Tensor, qk_nope_head_dim: int, v_head_dim: int,
                         scale: float) -> torch.Tensor:
    """One prompt chunk's attention with K and V decompressed: q [n, H, nope+R] holds the request's last n
    positions of seq_len, whose latent rows (the chunk's included) are already in the cache. Returns
    [n, H, v_head_dim]."""
    n, H, _ = q.shape
    block_size, L = kv_cache.shape[1], kv_b_weight.shape[1]
    pos = torch.arange(seq_len, device=q.device)
    rows = kv_cache.view(-1, kv_cache.shape[-1])[block_row[pos // block_size].long() * block_size + pos % block_size]
    kv = (rows[:, :L].to(q.dtype) @ kv_b_weight.to(q.dtype).t()).view(seq_len, H, qk_nope_head_dim + v_head_dim)
    k_rope = rows[:, None, L:].to(q.dtype).expand(seq_len, H, -1)
    k = torch.cat([kv[..., :qk_nope_head_dim], k_rope], dim=-1)
    v = kv[..., qk_nope_head_dim:]
    # Queries are the last n of seq_len positions: causal aligned to the lower right (top left when n == seq_len).
    mask = None if n == seq_len else causal_lower_right(n, seq_len)
    q, k, v = (_pad_head_dim(x) for x in (q, k, v))  # zero columns: scores unchanged, outputs sliced off
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and v.shape[-1] < k.shape[-1] <= 256:
        # SDPA's flash kernel needs v's head dim equal to q/k's (192 vs 128 for Kimi), else it takes the
        # memory-efficient kernel (71 of 159 ms of GPU time at a 32K prompt); v's zero columns add 20% FLOPs.
        v = torch.nn.functional.pad(v, (0, k.shape[-1] - v.shape[-1]))
    args = (q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0))
    if q.is_cuda:
        with sdpa_kernel(_FLASH_BACKENDS):
            o = torch.nn.functional.scaled_dot_product_attention(*args, attn_mask=mask, is_causal=mask is None,
                                                                 scale=scale)
    else:
        o = torch.nn.functional.scaled_dot_product_attention(*args, attn_mask=mask, is_causal=mask is None,
                                                             scale=scale)
    return o.squeeze(0).transpose(0, 1)[..., :v_head_dim]


def _pad_head_dim(x: torch.Tensor) -> torch.Tensor:
    pad = -x.shape[-1] % _HEAD_DIM_ALIGN
    return torch.nn.functional.pad(x, (0, pad)) if pad else x
