"""The FlashInfer / FlashKDA glue against the installed libraries' real signatures, on CPU.

FlashInfer's KDA and trtllm-gen MLA kernels need Blackwell, but flashinfer-python imports on a CPU
(requirements/test.txt installs it). Each call the glue makes goes to a stub (tests/flashinfer_stubs.py) that binds
the arguments to the real function's signature, so a renamed, missing or unknown argument fails here, and then runs
reference math that checks the shapes, dtypes and layouts the library documents: fakes are left only for the math.
FlashKDA's real kernel runs in the GPU tests of test_kda_backends.py. Outputs and pool/cache updates must equal
the torch backends' on the same inputs.
"""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass

import flashinfer_stubs
import pytest
import torch
from flashinfer_stubs import BF16, D, F32, I32
from kda_harness import random_layer, rel_err

from vllm.attention.backend import AttentionCGSupport, CommonAttentionMetadata, LayerShapes
from vllm.attention.kda.flashinfer import FlashInferKDABackend
from vllm.attention.kda.flashkda import FlashKDABackend
from vllm.attention.kda.metadata import KDAAttention
from vllm.attention.kda.torch_ref import TorchKDABackend
from vllm.attention.mla.flashinfer_mla import FlashInferMLABackend, FlashInferMLAMetadataBuilder
from vllm.attention.mla.torch_ref import TorchMLABackend


@pytest.fixture
def real(monkeypatch):
    """The installed flashinfer's entry points bound to their real signatures, and flash_kda; the call log."""
    pytest.importorskip("flashinfer", reason="binds the glue to the real flashinfer-python (requirements/test.txt)")
    return flashinfer_stubs.install(monkeypatch, ("flashinfer", "flash_kda"))


def _set_capability(monkeypatch, cap):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)


def test_a_wrong_argument_name_fails_the_binding(real):
    import flashinfer.kda_decode
    with pytest.raises(TypeError, match="state_idx"):
        flashinfer.kda_decode.fused_kda_decode(*[None] * 11, state_idx=None)  # every required one, and a typo


# ---- KDA steps ---------------------------------------------------------------------------------------------------

@dataclass
class Row:
    num_tokens: int
    num_computed: int  # tokens cached before this step (0: a fresh prompt, no initial state)
    prefilling: bool
    slot: int


def _kda_step(H: int, rows: list[Row], lower_bound, state_dtype, seed: int, slots: int = 12,
              history_major: bool = False):
    gen = torch.Generator().manual_seed(seed)
    layer = random_layer(H, D, 4, lower_bound, "cpu", gen)
    P, T = H * D, sum(r.num_tokens for r in rows)
    conv = torch.randn(slots, 3 * P, 3, generator=gen).to(BF16)
    if history_major:  # fused_kda_decode's layout: [slots, 3P, 3] with strides [slot, 1, 3P]
        conv = conv.transpose(1, 2).contiguous().transpose(1, 2)
    ssm = (torch.randn(slots, H, D, D, generator=gen) * 0.3).to(state_dtype)
    inputs = tuple(torch.randn(T, n, generator=gen).to(BF16) for n in (3 * P, P, H, P))
    lens = torch.tensor([r.num_tokens for r in rows], dtype=I32)
    qsl = torch.cat([torch.zeros(1, dtype=I32), lens.cumsum(0).to(I32)])
    seq_lens = torch.tensor([r.num_computed + r.num_tokens for r in rows], dtype=I32)
    state_idx = torch.tensor([r.slot for r in rows], dtype=I32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(),
        num_reqs=len(rows), num_actual_tokens=T, max_query_len=int(lens.max()), max_seq_len=int(seq_lens.max()),
        block_table=torch.zeros(len(rows), 1, dtype=I32), slot_mapping=torch.full((T,), -1),
        is_prefilling=torch.tensor([r.prefilling for r in rows]), state_indices=state_idx,
        state_indices_cpu=state_idx.clone())
    return layer, inputs, (conv, ssm), common


@torch.no_grad()  # as in the engine: o_norm's weight is a parameter
def _run_kda(attn: KDAAttention, layer, inputs, pools, common):
    conv, ssm = (p.clone() for p in pools)  # clone keeps the (dense) layout
    out = attn.forward(layer, *inputs, conv, ssm, attn.builder(16).build(common))
    return out, conv, ssm


def _assert_matches_torch(attn: KDAAttention, layer, inputs, pools, common, bound: float):
    got = _run_kda(attn, layer, inputs, pools, common)
    want = _run_kda(KDAAttention(TorchKDABackend, TorchKDABackend), layer, inputs, pools, common)
    errs = {name: rel_err(g, w) for name, g, w in zip(("out", "conv", "ssm"), got, want)}
    assert max(errs.values()) <= bound, errs
    return got


DECODE_ROWS = [Row(1, 37, False, 5), Row(1, 3, False, 2), Row(1, 900, False, 11), Row(1, 12, False, 7)]
PREFILL_ROWS = [Row(70, 0, True, 3), Row(40, 64, True, 9), Row(1, 0, True, 6), Row(33, 200, True, 1)]
MIXED_ROWS = [Row(1, 40, False, 4), Row(50, 0, True, 8), Row(3, 17, False, 10), Row(20, 128, True, 0)]


@pytest.mark.parametrize("state_dtype", [F32, BF16])
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
def test_flashinfer_decode_matches_torch(real, state_dtype, lower_bound):
    layer, inputs, pools, common = _kda_step(12, DECODE_ROWS, lower_bound, state_dtype, seed=1, history_major=True)
    attn = KDAAttention(TorchKDABackend, FlashInferKDABackend)
    assert attn.conv_state_history_major
    _assert_matches_torch(attn, layer, inputs, pools, common, bound=1e-3)
    (call,) = real["fused_kda_decode"]
    assert call["lower_bound"] == lower_bound and call["state_indices"].tolist() == [5, 2, 11, 7]
    assert call["state"].dtype == state_dtype and call["state"].shape[0] == 12  # the whole pool, by slot


def test_flashinfer_decode_rows_on_the_null_slot_touch_nothing(real):
    """Capture dummies and padding rows sit on slot 0, FlashInfer's null slot: no refusal, no state read or
    written, and the real rows beside them are unaffected."""
    rows = DECODE_ROWS[:2] + [Row(1, 0, False, 0), Row(1, 0, False, 0)]
    layer, inputs, pools, common = _kda_step(12, rows, -5.0, F32, seed=2, history_major=True)
    attn = KDAAttention(TorchKDABackend, FlashInferKDABackend)
    out, conv, ssm = _run_kda(attn, layer, inputs, pools, common)
    assert torch.equal(conv[0], pools[0][0]) and torch.equal(ssm[0], pools[1][0])
    real_rows = _kda_step(12, rows[:2], -5.0, F32, seed=2, history_major=True)
    want = _run_kda(KDAAttention(TorchKDABackend, TorchKDABackend), layer, tuple(x[:2] for x in inputs),
                    pools, real_rows[3])
    assert rel_err(out[:2], want[0]) <= 1e-3 and not out[2:].any()


def test_flashinfer_decode_converts_weights_once(real):
    layer, inputs, (conv, ssm), common = _kda_step(12, DECODE_ROWS, -5.0, F32, seed=3, history_major=True)
    attn = KDAAttention(TorchKDABackend, FlashInferKDABackend)
    for _ in range(2):
        with torch.no_grad():
            attn.forward(layer, *inputs, conv, ssm, attn.builder(16).build(common))
    first, second = real["fused_kda_decode"]
    assert all(first[k] is second[k] for k in ("weight", "A_log", "dt_bias", "norm_weight"))


def test_flashinfer_decode_refuses_a_pool_in_the_other_layout(real):
    layer, inputs, (conv, ssm), common = _kda_step(12, DECODE_ROWS, -5.0, F32, seed=4)
    attn = KDAAttention(TorchKDABackend, FlashInferKDABackend)
    with pytest.raises(ValueError, match="history-major"):
        attn.forward(layer, *inputs, conv, ssm, attn.builder(16).build(common))
    assert not real["fused_kda_decode"]


def test_flashinfer_decode_refuses_multi_token_rows(real):
    rows = [Row(2, 37, False, 5), Row(1, 3, False, 2)]
    layer, inputs, (conv, ssm), common = _kda_step(12, rows, -5.0, F32, seed=5, history_major=True)
    attn = KDAAttention(TorchKDABackend, FlashInferKDABackend)
    with pytest.raises(NotImplementedError, match="--kda-decode-backend native"):
        attn.forward(layer, *inputs, conv, ssm, attn.builder(16).build(common))
    assert not real["fused_kda_decode"]


def test_flashinfer_decode_graph_support_is_one_token_rows():
    assert FlashInferKDABackend.decode_cudagraph_support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert not FlashInferKDABackend.decode_checkpoints  # so speculative decoding refuses it at start-up
    assert FlashKDABackend.runs_prefill and not FlashKDABackend.runs_decode


@pytest.mark.parametrize("rows", [PREFILL_ROWS, MIXED_ROWS], ids=["prefill", "mixed"])
@pytest.mark.parametrize("state_dtype", [F32, BF16])
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
def test_flashinfer_prefill_matches_torch(real, rows, state_dtype, lower_bound):
    layer, inputs, pools, common = _kda_step(12, rows, lower_bound, state_dtype, seed=6)
    # bf16-level bound: under the CPU interpreter our Triton conv truncates its bf16 output where the reference
    # rounds (a wrong slot, gate or state would be off by far more).
    _assert_matches_torch(KDAAttention(FlashInferKDABackend, TorchKDABackend), layer, inputs, pools, common, 1e-2)
    (call,) = real["recurrent_kda"]
    prefill = [r for r in rows if r.prefilling]
    assert call["cu_seqlens"].dtype == torch.int64 and call["initial_state"].shape[0] == len(prefill)
    assert call["lower_bound"] == lower_bound and call["initial_state"].dtype == state_dtype
    # Fresh prompts start from zeros, continued ones from their slot's state.
    for n, r in enumerate(prefill):
        assert bool(call["initial_state"][n].any()) == (r.num_computed > 0)


@pytest.mark.parametrize("rows", [PREFILL_ROWS, MIXED_ROWS], ids=["prefill", "mixed"])
@pytest.mark.parametrize("state_dtype", [F32, BF16])
def test_flashkda_prefill_matches_torch(real, rows, state_dtype):
    layer, inputs, pools, common = _kda_step(8, rows, -5.0, state_dtype, seed=7)
    _assert_matches_torch(KDAAttention(FlashKDABackend, TorchKDABackend), layer, inputs, pools, common, bound=1e-2)
    (call,) = real["flash_kda"]
    # States go in and out in the pool's dtype (no rounding for an fp32 pool).
    assert call["initial_state"].dtype == call["final_state"].dtype == state_dtype
    assert call["lower_bound"] == -5.0 and call["scale"] == D ** -0.5


# ---- MLA steps ---------------------------------------------------------------------------------------------------

H_MLA, NOPE, ROPE, V_DIM, LORA, BS = 4, 128, 64, 128, 512, 32
SCALE = (NOPE + ROPE) ** -0.5


def _mla_step(ctx: list[int], qlens: list[int], prefilling: list[bool], seed: int, max_query_len: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx, qlens)]
    num_blocks, width = 40, 8
    perm = torch.randperm(num_blocks, generator=gen)  # scattered blocks
    block_table = torch.zeros(len(ctx), width, dtype=I32)
    slot_mapping, used = [], 0
    for r, n in enumerate(seq_lens):
        nb = -(-n // BS)
        block_table[r, :nb] = perm[used:used + nb].to(I32)
        used += nb
        slot_mapping += [int(block_table[r, p // BS]) * BS + p % BS for p in range(ctx[r], n)]
    T = sum(qlens)
    qsl = torch.tensor([0] + qlens).cumsum(0).to(I32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=torch.tensor(seq_lens, dtype=I32),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=I32), num_reqs=len(ctx), num_actual_tokens=T,
        max_query_len=max_query_len or max(qlens), max_seq_len=max(seq_lens), block_table=block_table,
        slot_mapping=torch.tensor(slot_mapping), is_prefilling=torch.tensor(prefilling),
        state_indices=torch.zeros(len(ctx), dtype=I32), state_indices_cpu=torch.zeros(len(ctx), dtype=I32))
    q = torch.randn(T, H_MLA, NOPE + ROPE, generator=gen).to(BF16)
    latent = torch.randn(T, LORA + ROPE, generator=gen).to(BF16)
    w_kvb = (torch.randn(H_MLA * (NOPE + V_DIM), LORA, generator=gen) * LORA ** -0.5).to(BF16)
    kv_cache = torch.randn(num_blocks, BS, LORA + ROPE, generator=gen).to(BF16)
    return common, q, latent, w_kvb, kv_cache


def _assert_mla_matches_torch(step, layers: int = 2):
    common, q, latent, w_kvb, kv_cache = step
    meta = FlashInferMLAMetadataBuilder(BS).build(common)
    cache = kv_cache.clone()
    for _ in range(layers):  # the step's layers share one metadata
        got = FlashInferMLABackend.forward(q, latent, cache, w_kvb, NOPE, V_DIM, SCALE, meta)
    ref_cache = kv_cache.clone()
    want = TorchMLABackend.forward(q, latent, ref_cache, w_kvb, NOPE, V_DIM, SCALE,
                                   TorchMLABackend.builder(BS).build(common))
    assert torch.equal(cache, ref_cache)  # the new latent rows, written by slot
    assert rel_err(got, want) <= 2e-2


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="FLASHINFER_MLA writes the latent cache with TRITON_MLA's Triton kernel")


@needs_triton
def test_trtllm_ragged_decode_matches_torch(real):
    # Decode and verify rows of 1..3 tokens; the runner's promised bound (4) exceeds the longest row.
    step = _mla_step([37, 3, 90, 12], [1, 3, 1, 2], [False] * 4, seed=0, max_query_len=4)
    assert FlashInferMLAMetadataBuilder.cudagraph_support == AttentionCGSupport.ALWAYS
    _assert_mla_matches_torch(step)
    common = step[0]
    calls = real["trtllm_batch_decode_with_kv_cache_mla"]
    assert len(calls) == 2 and not real["wrapper_init"]
    # The device offsets themselves and the promised bound: nothing re-measured on the host.
    assert calls[0]["cum_seq_lens_q"].data_ptr() == common.query_start_loc.data_ptr()
    assert calls[0]["max_q_len"] == 4 and calls[0]["seq_lens"].data_ptr() == common.seq_lens.data_ptr()
    assert calls[0]["bmm1_scale"] == SCALE


@needs_triton
def test_trtllm_capture_dummies_write_no_cache_row(real):
    """A graph capture's step: every token's cache row is -1 and rows sit on block 0; nothing is written."""
    common, q, latent, w_kvb, kv_cache = _mla_step([0, 0], [1, 1], [False, False], seed=3)
    common.slot_mapping = torch.full((2,), -1)
    cache = kv_cache.clone()
    FlashInferMLABackend.forward(q, latent, cache, w_kvb, NOPE, V_DIM, SCALE,
                                 FlashInferMLAMetadataBuilder(BS).build(common))
    assert torch.equal(cache, kv_cache)


@needs_triton
def test_wrapper_runs_steps_with_a_prompt(real):
    step = _mla_step([0, 40, 17, 64], [33, 1, 3, 20], [True, False, False, True], seed=1)
    _assert_mla_matches_torch(step)
    assert not real["trtllm_batch_decode_with_kv_cache_mla"] and len(real["wrapper_init"]) == 1
    assert len(real["plan"]) == 1 and len(real["run"]) == 2  # planned once per step, run per layer
    plan = real["plan"][0]
    assert plan["causal"] and plan["qo_indptr"].data_ptr() == step[0].query_start_loc.data_ptr()
    assert plan["kv_len_arr"].data_ptr() == step[0].seq_lens.data_ptr()


# ---- supports() --------------------------------------------------------------------------------------------------

KDA_OK = LayerShapes(kda_num_heads=12, kda_head_dim=128, kda_gate_bounded=True, ssm_state_dtype=F32)
MLA_OK = LayerShapes(mla_num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, block_size=64)
CUDA = torch.device("cuda")
ALL = (FlashInferKDABackend, FlashKDABackend, FlashInferMLABackend)


def test_supports_without_the_libraries(monkeypatch):
    for name in ("flashinfer", "flashinfer.kda_decode", "flashinfer.kda", "flashinfer.mla", "flash_kda"):
        monkeypatch.setitem(sys.modules, name, None)  # importing these now fails, installed or not
    _set_capability(monkeypatch, (10, 0))
    assert "pip install 'vllm[flashinfer]'" in FlashInferKDABackend.supports(CUDA, BF16, KDA_OK)
    assert "pip install 'vllm[flashinfer]'" in FlashInferMLABackend.supports(CUDA, BF16, MLA_OK)
    assert "not on PyPI" in FlashKDABackend.supports(CUDA, BF16, KDA_OK)


def test_supports_on_cpu(real):
    for backend in ALL:
        assert "needs a CUDA device" in backend.supports(torch.device("cpu"), BF16)


@needs_triton
@pytest.mark.parametrize("capability,kda_fi,flashkda,mla", [
    ((10, 0), None, None, None),
    ((10, 3), None, None, None),
    ((9, 0), "sm90", None, "sm90"),
    ((12, 0), "sm120", None, "sm120"),
    ((8, 9), "sm89", "sm89", "sm89"),
])
def test_supports_by_architecture(real, monkeypatch, capability, kda_fi, flashkda, mla):
    _set_capability(monkeypatch, capability)
    for backend, shapes, want in ((FlashInferKDABackend, KDA_OK, kda_fi), (FlashKDABackend, KDA_OK, flashkda),
                                  (FlashInferMLABackend, MLA_OK, mla)):
        reason = backend.supports(CUDA, BF16, shapes)
        assert (reason is None) if want is None else (want in reason), (backend.name, reason)
    if capability == (9, 0):  # Hopper: FlashInfer MLA refuses with its reason and the way out
        assert "TRITON_MLA" in FlashInferMLABackend.supports(CUDA, BF16, MLA_OK)


@needs_triton
def test_supports_refuses_shapes_and_dtypes(real, monkeypatch):
    _set_capability(monkeypatch, (10, 0))
    fi, fk = FlashInferKDABackend.supports, FlashKDABackend.supports
    kda = {"kda_num_heads": 12, "kda_head_dim": 128, "kda_gate_bounded": True}
    assert "head_dim 128" in fi(CUDA, BF16, LayerShapes(**{**kda, "kda_head_dim": 64}))
    assert "head_dim 128" in fk(CUDA, BF16, LayerShapes(**{**kda, "kda_head_dim": 64}))
    assert "(12, 24, 32, 48, 96)" in fi(CUDA, BF16, LayerShapes(**{**kda, "kda_num_heads": 16}))
    assert fk(CUDA, BF16, LayerShapes(**{**kda, "kda_num_heads": 16})) is None  # FlashKDA takes any head count
    assert "bounded gate" in fk(CUDA, BF16, LayerShapes(**{**kda, "kda_gate_bounded": False}))
    assert fi(CUDA, BF16, LayerShapes(**{**kda, "kda_gate_bounded": False})) is None  # FlashInfer has both gates
    assert "fp32 or bf16" in fi(CUDA, BF16, LayerShapes(**kda, ssm_state_dtype=torch.float16))
    for backend in ALL:
        assert "bf16" in backend.supports(CUDA, torch.float16)
    mla = FlashInferMLABackend.supports
    assert "block size 32 or 64" in mla(CUDA, BF16, LayerShapes(kv_lora_rank=512, qk_rope_head_dim=64, block_size=16))
    assert "kv_lora_rank 512" in mla(CUDA, BF16, LayerShapes(kv_lora_rank=256, qk_rope_head_dim=64, block_size=64))


@needs_triton
def test_supports_needs_ragged_trtllm_decode(real, monkeypatch):
    import flashinfer.mla

    def old_trtllm(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim,
                   block_tables, seq_lens, max_seq_len, sparse_mla_top_k=0, out=None, bmm1_scale=1.0,
                   bmm2_scale=1.0, sinks=None, enable_pdl=None, backend="auto"):
        raise AssertionError("not called")
    monkeypatch.setattr(flashinfer.mla, "trtllm_batch_decode_with_kv_cache_mla", old_trtllm)
    _set_capability(monkeypatch, (10, 0))
    assert "cum_seq_lens_q" in FlashInferMLABackend.supports(CUDA, BF16, MLA_OK)
