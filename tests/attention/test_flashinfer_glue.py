"""The FlashInfer / FlashKDA glue against the installed libraries' real signatures, on CPU.

FlashInfer's KDA and trtllm-gen MLA kernels need Blackwell, but flashinfer-python imports on a CPU
(requirements/test.txt installs it). Each call the glue makes goes to a stub that binds the arguments to the real
function's signature (`inspect.signature` of the installed library: a renamed, missing or unknown argument fails
here) and then runs our reference math, which checks the shapes, dtypes and layouts the library documents. So
fakes are left only for the math. FlashKDA is not on PyPI and is built for the GPU machine only, so its stub
carries the signature of `flash_kda.fwd` as built there (../shared/device/flashkda; the real kernel runs in the
GPU tests of test_kda_backends.py). Outputs and pool/cache updates must equal the torch backends' on the same inputs.
"""
from __future__ import annotations

import importlib.util
import inspect
import sys
import types
from collections import defaultdict
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from kda_harness import random_layer, rel_err

from vllm.attention.backend import AttentionCGSupport, CommonAttentionMetadata, LayerShapes
from vllm.attention.kda.flashinfer import FlashInferKDABackend
from vllm.attention.kda.flashkda import FlashKDABackend
from vllm.attention.kda.metadata import KDAAttention
from vllm.attention.kda.ops import kda_chunked, kda_gate, kda_recurrent, l2norm
from vllm.attention.kda.torch_ref import TorchKDABackend
from vllm.attention.mla.flashinfer_mla import FlashInferMLABackend, FlashInferMLAMetadataBuilder
from vllm.attention.mla.torch_ref import TorchMLABackend

BF16, F32, I32 = torch.bfloat16, torch.float32, torch.int32
D = 128  # the libraries' KDA head dim


# ---- reference math behind the real signatures -----------------------------------------------------------------

def fused_kda_decode(x, weight, conv_state, raw_gate, raw_beta, A_log, dt_bias, state_indices, state, output_gate,
                     norm_weight, lower_bound, norm_eps, output, backend, state_indices_mode):
    n, H = x.shape[0], A_log.shape[0]
    P = H * D
    assert H in (8, 12, 24, 32, 48, 96) and backend == "cute-dsl" and state_indices_mode is None
    assert x.dtype == BF16 and x.shape == (n, 3 * P) and x.stride(1) == 1
    assert weight.dtype == F32 and weight.shape == (3, 4, P) and weight.is_contiguous()
    assert conv_state.dtype == BF16 and conv_state.shape[1:] == (3 * P, 3)
    assert conv_state.stride()[1:] == (1, 3 * P), "conv_state must use the SD cache layout"
    assert raw_gate.dtype == BF16 and raw_gate.shape == (1, n, H, D) and raw_gate.is_contiguous()
    assert raw_beta.dtype == BF16 and raw_beta.shape == (1, n, H) and raw_beta.stride(2) == 1
    assert A_log.dtype == F32 and A_log.shape == (H,) and dt_bias.dtype == F32 and dt_bias.shape == (P,)
    assert state_indices.dtype == I32 and state_indices.shape == (n,) and state_indices.is_contiguous()
    assert state.dtype in (F32, BF16) and state.shape[1:] == (H, D, D) and state.stride()[1:] == (D * D, D, 1)
    assert state.shape[0] == conv_state.shape[0]
    gate = output_gate[0] if output_gate.dim() == 4 else output_gate
    assert gate.dtype == BF16 and gate.shape == (n, H, D) and gate.stride()[1:] == (D, 1)
    assert norm_weight.dtype == F32 and norm_weight.shape == (D,)
    assert lower_bound is None or lower_bound < 0
    out = torch.zeros(1, n, H, D, dtype=BF16)
    w = weight.permute(0, 2, 1).reshape(3 * P, 4)
    for r, slot in enumerate(state_indices.tolist()):
        if slot <= 0:
            continue  # the null slot: zero output, caches untouched
        window = torch.cat([conv_state[slot], x[r, :, None]], dim=-1)
        mixed = F.silu((window.float() * w).sum(-1)).to(BF16).float()
        q, k, v = (t.view(1, H, D) for t in mixed.chunk(3))
        g = kda_gate(raw_gate[0, r].reshape(1, P), A_log, dt_bias, D, lower_bound)
        o, S = kda_recurrent(l2norm(q) * D ** -0.5, l2norm(k), v, g, torch.sigmoid(raw_beta[0, r].float())[None],
                             state[slot])
        state[slot] = S.to(state.dtype)
        conv_state[slot] = window[:, 1:]
        o = o[0].to(BF16).float()
        y = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + norm_eps) * norm_weight * torch.sigmoid(gate[r].float())
        out[0, r] = y.to(BF16)
    return out if output is None else output.copy_(out)


def recurrent_kda(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                  use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound, cu_seqlens, beta_is_logit, **rest):
    _, T, H, K = q.shape
    unused = ("ssm_state_indices", "num_spec_tokens", "num_accepted_tokens", "output", "initial_state_source",
              "state_checkpoints", "seq_order", "prefill_workspace")
    assert all(rest[name] is None for name in unused) and rest["backend"] == "auto"
    for t in (q, k, v, g):
        assert t.dtype == BF16 and t.shape == (1, T, H, K) and t.is_contiguous()
    assert beta.dtype == BF16 and beta.shape == (1, T, H)
    assert A_log.dtype == F32 and A_log.shape == (H,) and dt_bias.dtype == F32 and dt_bias.numel() == H * K
    assert cu_seqlens.dtype in (torch.int32, torch.int64) and cu_seqlens.dim() == 1 and int(cu_seqlens[-1]) == T
    N = cu_seqlens.numel() - 1
    assert initial_state.dtype in (BF16, F32) and initial_state.shape == (N, H, K, K), "[N, HV, V, K] state"
    assert use_qk_l2norm_in_kernel and use_gate_in_kernel and beta_is_logit and output_final_state
    gate = kda_gate(g[0].reshape(T, H * K), A_log, dt_bias.reshape(-1), K, lower_bound)
    b = torch.sigmoid(beta[0].float())
    qn, kn = l2norm(q[0]) * (K ** -0.5 if scale is None else scale), l2norm(k[0])
    o, final = torch.empty(T, H, K), torch.empty(N, H, K, K)
    for n, (s, e) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        o[s:e], final[n] = kda_chunked(qn[s:e], kn[s:e], v[0, s:e].float(), gate[s:e], b[s:e], initial_state[n])
    return o.to(BF16)[None], final.to(initial_state.dtype)


def flash_kda_fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None, final_state=None,
                  cu_seqlens=None):
    """flash_kda.fwd's signature as built on the GPU machine (flash_kda/__init__.py), with its documented checks."""
    B, T, H, K = q.shape
    for t in (q, k, v, g, out):
        assert t.dtype == BF16 and t.shape == q.shape and t.is_contiguous()
    assert beta.dtype == BF16 and beta.shape == (B, T, H) and beta.is_contiguous()
    assert K == 128 and A_log.dtype == F32 and A_log.shape == (H,) and A_log.is_contiguous()
    assert dt_bias.dtype == F32 and dt_bias.shape == (H, K) and dt_bias.is_contiguous()
    assert isinstance(lower_bound, float) and -5.0 <= lower_bound <= 0.0
    assert B == 1 and cu_seqlens.dtype == torch.int64 and cu_seqlens.dim() == 1
    N = cu_seqlens.numel() - 1
    for s in (initial_state, final_state):
        assert s.dtype in (BF16, F32) and s.shape == (N, H, K, K) and s.is_contiguous()
    assert initial_state.dtype == final_state.dtype
    gate = kda_gate(g[0].reshape(T, H * K), A_log, dt_bias.reshape(-1), K, lower_bound)
    b = torch.sigmoid(beta[0].float())
    qn, kn = l2norm(q[0]) * scale, l2norm(k[0])
    for n, (s, e) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        o, S = kda_chunked(qn[s:e], kn[s:e], v[0, s:e].float(), gate[s:e], b[s:e], initial_state[n])
        out[0, s:e] = o.to(BF16)
        final_state[n] = S.to(final_state.dtype)


def _latent_attention(q_lat, q_pe, ckv, kpe, scale):
    """Causal (bottom-right aligned) MQA of one request's rows in the latent space, float32 [t, H, L]."""
    t, S = q_lat.shape[0], ckv.shape[0]
    scores = (torch.einsum("thl,sl->hts", q_lat.float(), ckv.float())
              + torch.einsum("thr,sr->hts", q_pe.float(), kpe.float())) * scale
    visible = torch.arange(S)[None, :] <= (S - t + torch.arange(t))[:, None]
    return torch.einsum("hts,sl->thl", scores.masked_fill(~visible, float("-inf")).softmax(-1), ckv.float())


def trtllm_batch_decode_with_kv_cache_mla(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank,
                                          qk_rope_head_dim, block_tables, seq_lens, max_seq_len, sparse_mla_top_k,
                                          out, bmm1_scale, bmm2_scale, backend, lse, return_lse, cum_seq_lens_q,
                                          max_q_len, **rest):
    L, R = kv_lora_rank, qk_rope_head_dim
    assert (qk_nope_head_dim, L, R) == (128, 512, 64) and sparse_mla_top_k == 0 and out is None
    assert backend == "trtllm-gen" and lse is None and not return_lse, "ragged rows: trtllm-gen, no LSE"
    assert not rest["enable_dcp"] and rest["sinks"] is None
    assert query.dtype == BF16 and kv_cache.dtype == BF16 and isinstance(bmm1_scale, float) and bmm2_scale == 1.0
    assert cum_seq_lens_q.dtype == I32 and cum_seq_lens_q.dim() == 1 and max_q_len is not None
    B = cum_seq_lens_q.numel() - 1
    assert query.dim() == 3 and query.shape[0] >= int(cum_seq_lens_q[-1]) and query.shape[-1] == L + R
    assert kv_cache.dim() == 3 and kv_cache.shape[1] in (32, 64) and kv_cache.shape[-1] == L + R
    assert block_tables.dtype == I32 and block_tables.shape[0] == B and block_tables.stride(-1) == 1
    assert seq_lens.dtype == I32 and seq_lens.shape == (B,) and max_seq_len >= int(seq_lens.max())
    q_lens = cum_seq_lens_q[1:] - cum_seq_lens_q[:-1]
    assert max_q_len >= int(q_lens.max()), "max_q_len must bound every row"
    assert workspace_buffer.dtype == torch.uint8 and not workspace_buffer.any(), "workspace must start zeroed"
    page = kv_cache.shape[1]
    o = torch.zeros(query.shape[0], query.shape[1], L, dtype=BF16)
    for b in range(B):
        s, e, n = int(cum_seq_lens_q[b]), int(cum_seq_lens_q[b + 1]), int(seq_lens[b])
        if e == s:
            continue  # a zero-length (padding) row
        rows = kv_cache[block_tables[b, :-(-n // page)].long()].reshape(-1, L + R)[:n]
        o[s:e] = _latent_attention(query[s:e, :, :L], query[s:e, :, L:], rows[:, :L], rows[:, L:], bmm1_scale)
    return o


class MLAWrapperReference:
    """BatchMLAPagedAttentionWrapper's behaviour; `bind_wrapper` puts the real methods' signatures in front."""

    def __init__(self, log, float_workspace_buffer, use_cuda_graph, backend, **rest):
        assert float_workspace_buffer.dtype == torch.uint8 and not use_cuda_graph and backend == "auto"
        self.log = log
        log["wrapper_init"].append(float_workspace_buffer)

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type, **rest):
        for t in (qo_indptr, kv_indptr, kv_indices, kv_len_arr):
            assert t.dtype == I32 and t.dim() == 1
        assert qo_indptr.shape == kv_indptr.shape == (kv_len_arr.shape[0] + 1,)
        assert kv_indices.numel() >= int(kv_indptr[-1])
        assert head_dim_ckv in (128, 256, 512) and head_dim_kpe % 64 == 0 and rest["metadata"] is None
        self.log["plan"].append({"qo_indptr": qo_indptr, "kv_len_arr": kv_len_arr, "causal": causal})
        self.plan_args = (qo_indptr.clone(), kv_indptr.clone(), kv_indices.clone(), kv_len_arr.clone(), num_heads,
                          head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type)

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse, **rest):
        qo, kv_indptr, kv_indices, kv_len_arr, H, ckv, kpe, page, causal, scale, q_dtype, kv_dtype = self.plan_args
        assert out is None and lse is None and not return_lse
        assert q_nope.dtype == q_pe.dtype == q_dtype and ckv_cache.dtype == kpe_cache.dtype == kv_dtype
        assert q_nope.shape == (int(qo[-1]), H, ckv) and q_pe.shape == (int(qo[-1]), H, kpe)
        assert ckv_cache.shape[1:] == (page, ckv) and kpe_cache.shape[1:] == (page, kpe) and causal
        self.log["run"].append(1)
        o = torch.empty_like(q_nope)
        for b in range(kv_len_arr.shape[0]):
            s, e, n = int(qo[b]), int(qo[b + 1]), int(kv_len_arr[b])
            pages = kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])][:-(-n // page)].long()
            o[s:e] = _latent_attention(q_nope[s:e], q_pe[s:e], ckv_cache[pages].reshape(-1, ckv)[:n],
                                       kpe_cache[pages].reshape(-1, kpe)[:n], scale)
        return o


# ---- binding to the real signatures --------------------------------------------------------------------------

def bound_to(signature: inspect.Signature, log: dict, name: str, reference):
    """A stub with `signature`: binds every call to it (TypeError on a name the real function does not take),
    fills in the real defaults, records the arguments and runs `reference` on them all as keywords."""
    def stub(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        log[name].append(dict(bound.arguments))
        return reference(**bound.arguments)
    stub.__signature__ = signature
    return stub


def bind_wrapper(real: type, log: dict) -> type:
    """A class with the real wrapper's __init__/plan/run signatures in front of MLAWrapperReference."""
    sigs = {m: inspect.signature(getattr(real, m)) for m in ("__init__", "plan", "run")}

    class Wrapper:
        def __init__(self, *args, **kwargs):
            bound = sigs["__init__"].bind(self, *args, **kwargs)
            bound.apply_defaults()
            self.ref = MLAWrapperReference(log, **{k: v for k, v in bound.arguments.items() if k != "self"})

        def plan(self, *args, **kwargs):
            return self._call("plan", args, kwargs)

        def run(self, *args, **kwargs):
            return self._call("run", args, kwargs)

        def _call(self, method, args, kwargs):
            bound = sigs[method].bind(self, *args, **kwargs)
            bound.apply_defaults()
            return getattr(self.ref, method)(**{k: v for k, v in bound.arguments.items() if k != "self"})
    return Wrapper


FLASH_KDA_SIGNATURE = inspect.signature(flash_kda_fwd)


@pytest.fixture
def real(monkeypatch):
    """The installed flashinfer's entry points, each replaced by a stub bound to its own real signature, and a
    flash_kda module with the GPU build's signature; returns the call log."""
    pytest.importorskip("flashinfer", reason="binds the glue to the real flashinfer-python (requirements/test.txt)")
    import flashinfer.kda
    import flashinfer.kda_decode
    import flashinfer.mla
    log = defaultdict(list)
    for module, name, reference in ((flashinfer.kda_decode, "fused_kda_decode", fused_kda_decode),
                                    (flashinfer.kda, "recurrent_kda", recurrent_kda),
                                    (flashinfer.mla, "trtllm_batch_decode_with_kv_cache_mla",
                                     trtllm_batch_decode_with_kv_cache_mla)):
        monkeypatch.setattr(module, name, bound_to(inspect.signature(getattr(module, name)), log, name, reference))
    monkeypatch.setattr(flashinfer.mla, "BatchMLAPagedAttentionWrapper",
                        bind_wrapper(flashinfer.mla.BatchMLAPagedAttentionWrapper, log))
    flash_kda = types.ModuleType("flash_kda")
    flash_kda.fwd = bound_to(FLASH_KDA_SIGNATURE, log, "flash_kda", flash_kda_fwd)
    monkeypatch.setitem(sys.modules, "flash_kda", flash_kda)
    return log


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
