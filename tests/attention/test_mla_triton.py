"""TRITON_MLA equals the torch reference MLA backend: outputs and written cache rows, on ragged batches.

Without CUDA the kernels run on CPU tensors through the Triton interpreter, at small shapes.
"""
from __future__ import annotations

import os

import pytest
import torch

from vllm.attention.backend import AttentionCGSupport, CommonAttentionMetadata, QueryLenSupport
from vllm.attention.mla.torch_ref import TorchMLABackend
from vllm.attention.mla import triton_mla_kernels as kernels
from vllm.attention.mla.triton_mla import TritonMLABackend

DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                       reason="CPU tensors need the Triton interpreter")),
           pytest.param("cuda", marks=pytest.mark.gpu)]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=5e-3, atol=5e-3)}
SMALL = dict(H=4, nope=16, rope=16, v=12, L=64, bs=4)
REAL = dict(H=16, nope=128, rope=64, v=128, L=512, bs=64)
# A fresh prompt, a decode row, a 4-token verify row, a prompt chunk over cached context, a short decode row.
RAGGED = dict(ctx=[0, 40, 63, 50, 2], qlens=[7, 1, 4, 12, 1])


def _make_common(ctx, qlens, bs, num_blocks, device, gen, pad=1, qsl_cpu=None, max_blocks=None):
    """Layout for rows with `ctx` cached and `qlens` new tokens, blocks scattered, `pad` trailing padding tokens."""
    seq_lens = [c + q for c, q in zip(ctx, qlens)]
    n = len(seq_lens)
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(n, max_blocks or max(-(-s // bs) for s in seq_lens), dtype=torch.int32)
    slots, used = [], 0
    for r, s in enumerate(seq_lens):
        nb = -(-s // bs)
        block_table[r, :nb] = perm[used:used + nb].int()
        used += nb
        slots += [int(block_table[r, p // bs]) * bs + p % bs for p in range(ctx[r], s)]
    qsl = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0).int()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl if qsl_cpu is None else qsl_cpu,
        seq_lens=lens.to(device), seq_lens_cpu=lens, num_reqs=n, num_actual_tokens=sum(qlens) + pad,
        max_query_len=max(qlens), max_seq_len=max(seq_lens), block_table=block_table.to(device),
        slot_mapping=torch.tensor(slots + [-1] * pad, dtype=torch.int64, device=device),
        is_prefilling=torch.tensor([c == 0 or q > 4 for c, q in zip(ctx, qlens)]),
        state_indices=torch.zeros(n, dtype=torch.int32, device=device),
        state_indices_cpu=torch.zeros(n, dtype=torch.int32))


def _inputs(T, H, nope, rope, v, L, num_blocks, bs, dtype, device, gen):
    q = torch.randn(T, H, nope + rope, generator=gen)
    latent = torch.randn(T, L + rope, generator=gen)
    kv_cache = torch.randn(num_blocks, bs, L + rope, generator=gen)  # stale rows everywhere, never zeros
    w_kvb = torch.randn(H * (nope + v), L, generator=gen) * L ** -0.5
    return [x.to(device=device, dtype=dtype) for x in (q, latent, kv_cache, w_kvb)]


ALL_ABSORBED = 1 << 30  # prefill_min_query_len that keeps every row on the absorbed kernel


def _run_both(common, q, latent, kv_cache, w_kvb, dims, num_splits=None, triton_meta=None,
              prefill_min_query_len=ALL_ABSORBED):
    """(triton out, triton cache, reference out, reference cache) from the same inputs."""
    scale = (dims["nope"] + dims["rope"]) ** -0.5
    meta = triton_meta or TritonMLABackend.builder(dims["bs"], num_splits, prefill_min_query_len).build(common)
    cache = kv_cache.clone()
    out = TritonMLABackend.forward(q, latent, cache, w_kvb, dims["nope"], dims["v"], scale, meta)
    ref_cache = kv_cache.float().clone()
    ref = TorchMLABackend.forward(q.float(), latent.float(), ref_cache, w_kvb.float(), dims["nope"], dims["v"],
                                  scale, TorchMLABackend.builder(dims["bs"]).build(common))
    return out, cache, ref, ref_cache


def _check(out, cache, ref, ref_cache, n_tokens, dtype):
    assert out.dtype == dtype and out.shape[1:] == ref.shape[1:]
    torch.testing.assert_close(cache.float(), ref_cache.to(dtype).float(), rtol=0, atol=0)
    torch.testing.assert_close(out[:n_tokens].float(), ref[:n_tokens], **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [None, 1, 3, 8])
def test_ragged_rows_match_reference(device, dtype, num_splits):
    gen = torch.Generator().manual_seed(0)
    d, num_blocks = SMALL, 80
    common = _make_common(RAGGED["ctx"], RAGGED["qlens"], d["bs"], num_blocks, device, gen)
    n = sum(RAGGED["qlens"])
    inputs = _inputs(n + 1, d["H"], d["nope"], d["rope"], d["v"], d["L"], num_blocks, d["bs"], dtype, device, gen)
    _check(*_run_both(common, *inputs, d, num_splits), n, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_long_prompt_chunks_run_unabsorbed_and_match_reference(device, dtype):
    """Rows 0 (a fresh 7-token prompt) and 3 (a 12-token chunk over 50 cached positions: lower-right causal)
    are prompt chunks longer than 4 tokens, so they take decompressed K/V and flash attention; the decode row,
    the 4-token verify row and the short decode row stay on the absorbed kernel in the same step."""
    gen = torch.Generator().manual_seed(6)
    d, num_blocks = SMALL, 80
    common = _make_common(RAGGED["ctx"], RAGGED["qlens"], d["bs"], num_blocks, device, gen)
    meta = TritonMLABackend.builder(d["bs"], prefill_min_query_len=4).build(common)
    assert [(r.req, r.q_start, r.q_end, r.seq_len) for r in meta.prefill_rows] == [(0, 0, 7, 7), (3, 12, 24, 62)]
    assert meta.max_query_len == 4 and meta.skip_reqs.tolist() == [1, 0, 0, 1, 0]
    n = sum(RAGGED["qlens"])
    inputs = _inputs(n + 1, d["H"], d["nope"], d["rope"], d["v"], d["L"], num_blocks, d["bs"], dtype, device, gen)
    _check(*_run_both(common, *inputs, d, triton_meta=meta), n, dtype)


def test_capture_keeps_every_row_absorbed():
    """Inside graph capture the unabsorbed plan (host row lengths) would be frozen into the graph: the capture
    entry point makes none, where build makes one for the same step."""
    gen = torch.Generator().manual_seed(7)
    common = _make_common(RAGGED["ctx"], RAGGED["qlens"], 4, 80, "cpu", gen)
    builder = TritonMLABackend.builder(4, prefill_min_query_len=4)
    meta = builder.build_for_capture(common)
    assert meta.prefill_rows == () and meta.skip_reqs is None and meta.max_query_len == 12
    assert builder.build(common).prefill_rows, "the same step built eagerly plans its long chunks unabsorbed"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("H,L", [(2, 32), (3, 48)])
def test_odd_head_counts_and_latent_widths(device, H, L):
    # H=3 puts rows of different tokens in one row block; L=48 is not a power of two (masked lanes).
    gen = torch.Generator().manual_seed(1)
    d, num_blocks = dict(SMALL, H=H, L=L, bs=8), 40
    common = _make_common([0, 33, 90], [5, 3, 1], d["bs"], num_blocks, device, gen)
    inputs = _inputs(10, H, d["nope"], d["rope"], d["v"], L, num_blocks, d["bs"], torch.float32, device, gen)
    _check(*_run_both(common, *inputs, d, num_splits=4), 9, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_follows_device_query_start_loc(device):
    # The CPU offsets disagree row by row with the device ones (same total); the builder must not read
    # them, and the output must follow the device layout.
    gen = torch.Generator().manual_seed(2)
    d, num_blocks = SMALL, 60
    ctx, qlens = [20, 35, 0], [1, 4, 3]
    wrong_cpu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    common = _make_common(ctx, qlens, d["bs"], num_blocks, device, gen, qsl_cpu=wrong_cpu)
    assert TritonMLABackend.builder(d["bs"]).supports_device_cpu_query_lens_mismatch()
    inputs = _inputs(9, d["H"], d["nope"], d["rope"], d["v"], d["L"], num_blocks, d["bs"], torch.float32, device,
                     gen)
    meta = TritonMLABackend.builder(d["bs"], num_splits=2).build(common)
    common.query_start_loc_cpu = common.query_start_loc.cpu()  # the reference reads the CPU copy
    _check(*_run_both(common, *inputs, d, triton_meta=meta), 8, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_fixed_grid_replays_new_lengths(device):
    # As in a CUDA-graph replay: metadata built once, then the device tensors it holds change in place.
    gen = torch.Generator().manual_seed(3)
    d, num_blocks = SMALL, 80
    first = _make_common([10, 5, 30], [2, 1, 3], d["bs"], num_blocks, device, gen, pad=0, max_blocks=30)
    meta = TritonMLABackend.builder(d["bs"], num_splits=4).build(first)
    second = _make_common([70, 0, 44], [1, 3, 2], d["bs"], num_blocks, device, gen, pad=0, max_blocks=30)
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        getattr(first, name).copy_(getattr(second, name))
    inputs = _inputs(6, d["H"], d["nope"], d["rope"], d["v"], d["L"], num_blocks, d["bs"], torch.float32, device,
                     gen)
    _check(*_run_both(second, *inputs, d, triton_meta=meta), 6, torch.float32)


def test_builder_and_supports_contract():
    b = TritonMLABackend.builder(16)
    assert TritonMLABackend.name == "TRITON_MLA"
    assert b.cudagraph_support == AttentionCGSupport.ALWAYS and b.query_len_support == QueryLenSupport.VARLEN
    assert "dtype" in TritonMLABackend.supports(torch.device("cpu"), torch.int8)
    # The interpreter is a test vehicle: the CPU is refused even with it on, so `auto` never picks it there.
    assert "needs a CUDA GPU" in TritonMLABackend.supports(torch.device("cpu"), torch.bfloat16)
    if torch.cuda.is_available():
        assert TritonMLABackend.supports(torch.device("cuda"), torch.bfloat16) is None


def test_auto_num_splits():
    """Many splits for one long decode row, one for a big batch or a long prompt chunk; capped by the split
    length, the split count and the partials' bytes (an L2-sized budget, or a share of the step's roofline
    bytes: cache reads, or FLOPs over the ridge point when the rows make the step compute-bound)."""
    n_sms, L, row = 132, 512, 1152

    def splits(num_reqs, rows, block_m, seq):
        return kernels.auto_num_splits(num_reqs, rows, block_m, L, seq, row, n_sms)

    assert splits(1, 16, 16, 8192) == 8192 // kernels.MIN_SPLIT_LEN
    assert splits(1, 16, 16, 1 << 20) == kernels.MAX_SPLITS
    assert splits(1, 16, 16, 100) == 1
    assert splits(128, 64, 64, 8192) == 1  # 128 programs already fill the 132 SMs
    assert splits(32, 64, 64, 8192) == 4  # 32 want 4 splits; their partials are 14% of the cache reads
    # 8-token rows at 64 heads are compute-bound: their 16 MiB of partials per split are weighed against the
    # step's FLOPs (against its cache bytes alone, one split would fit and leave 64 programs on 132 SMs).
    assert max(kernels.PARTIAL_BUDGET_BYTES, kernels.PARTIAL_SHARE * 8 * 8192 * row) // (8 * 512 * L * 8) == 1
    assert splits(8, 512, 64, 8192) == 2
    assert splits(1, 2048, 64, 2048) == kernels.PARTIAL_BUDGET_BYTES // (2048 * L * 8)  # 16 tokens x 128 heads
    # 4-token rows at 128 heads: 512 rows x 8 KiB of partial traffic per request and split. At 8K positions
    # the budget allows a few splits for 2 requests; at 64 requests none.
    two = splits(2, 512, 64, 8192)
    assert 1 < two and two * 2 * 512 * L * 8 <= kernels.PARTIAL_BUDGET_BYTES
    assert splits(64, 512, 64, 8192) == 1


@pytest.mark.parametrize("prefill_min_query_len", [ALL_ABSORBED, 4])
def test_build_reads_no_device_values(prefill_min_query_len):
    # Every device tensor on the meta device: any read of one (.tolist(), .item(), a per-request loop) raises,
    # so this build would also run without a sync inside CUDA-graph capture. The unabsorbed plan reads only
    # the host copies.
    gen = torch.Generator().manual_seed(5)
    common = _make_common(RAGGED["ctx"], RAGGED["qlens"], 4, 64, "cpu", gen)
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "state_indices"):
        setattr(common, name, getattr(common, name).to("meta"))
    meta = TritonMLABackend.builder(4, prefill_min_query_len=prefill_min_query_len).build(common)
    assert meta.query_start_loc.shape == (6,) and meta.slot_mapping.shape == (common.num_actual_tokens,)
    # Without prompt chunks the kernel picks the splits; with them, the absorbed rows run unsplit.
    expected = (5, 12, None) if prefill_min_query_len == ALL_ABSORBED else (5, 4, 1)
    assert (meta.num_reqs, meta.max_query_len, meta.num_splits) == expected


@pytest.mark.gpu
@pytest.mark.parametrize("prefill_min_query_len", [ALL_ABSORBED, 16])
@pytest.mark.parametrize("dtype,H,num_splits", [(torch.bfloat16, 16, None), (torch.bfloat16, 16, 1),
                                                (torch.bfloat16, 16, 16), (torch.bfloat16, 128, 8),
                                                (torch.float16, 64, None), (torch.float32, 16, 4)])
def test_real_shapes_cuda(dtype, H, num_splits, prefill_min_query_len):
    """With the default threshold the 300-token prompt and the 64-token chunk over 2,000 cached positions run
    unabsorbed (flash attention); with none, every row runs the absorbed kernel with the given splits."""
    gen = torch.Generator().manual_seed(4)
    d, num_blocks = dict(REAL, H=H), 400
    ctx, qlens = [0, 3000, 1200, 4095, 700, 2000], [300, 1, 4, 1, 8, 64]
    common = _make_common(ctx, qlens, d["bs"], num_blocks, "cuda", gen)
    n = sum(qlens)
    inputs = _inputs(n + 1, H, d["nope"], d["rope"], d["v"], d["L"], num_blocks, d["bs"], dtype, "cuda", gen)
    _check(*_run_both(common, *inputs, d, num_splits, prefill_min_query_len=prefill_min_query_len), n, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prompt_chunks_of_a_step_in_one_varlen_call_cuda(dtype):
    """A served wave's step: fresh prompts, chunks over cached context (lower-right causal) and decode rows
    together; the chunks run in one varlen flash call (unabsorbed_varlen), matching the reference per row."""
    from vllm.attention.mla.triton_mla import _varlen_flash_fits
    gen = torch.Generator().manual_seed(7)
    d, num_blocks = dict(REAL, H=32), 400
    ctx, qlens = [0, 900, 0, 2000, 37, 0, 1500], [256, 1, 17, 64, 100, 300, 1]
    common = _make_common(ctx, qlens, d["bs"], num_blocks, "cuda", gen)
    meta = TritonMLABackend.builder(d["bs"]).build(common)
    assert [r.req for r in meta.prefill_rows] == [0, 2, 3, 4, 5] and meta.varlen.max_q == 300
    n = sum(qlens)
    inputs = _inputs(n + 1, d["H"], d["nope"], d["rope"], d["v"], d["L"], num_blocks, d["bs"], dtype, "cuda", gen)
    assert _varlen_flash_fits(inputs[0], d["v"])
    _check(*_run_both(common, *inputs, d, triton_meta=meta), n, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("prefill_min_query_len", [ALL_ABSORBED, 4])
def test_build_does_not_sync_cuda(prefill_min_query_len):
    gen = torch.Generator().manual_seed(5)
    common = _make_common(RAGGED["ctx"], RAGGED["qlens"], 16, 64, "cuda", gen)
    torch.cuda.set_sync_debug_mode("error")
    try:
        TritonMLABackend.builder(16, prefill_min_query_len=prefill_min_query_len).build(common)
    finally:
        torch.cuda.set_sync_debug_mode("default")
