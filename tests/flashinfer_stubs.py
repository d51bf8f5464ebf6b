"""Stubs for the kernel libraries the CPU cannot run: each binds a call to the installed library's real signature
(a renamed, missing or unknown argument raises TypeError) and then runs reference math that checks the shapes,
dtypes and layouts the library documents. Used by the glue tests and the graph-capture tests.

FlashKDA is not on PyPI and is built for the GPU machine only, so its stub carries the signature of
`flash_kda.fwd` as built there (../shared/device/flashkda).
"""
from __future__ import annotations

import inspect
import sys
import types
from collections import defaultdict

import graph_standin
import torch
import torch.nn.functional as F

from vllm.attention.kda.ops import kda_chunked, kda_gate, kda_recurrent, l2norm

BF16, F32, I32 = torch.bfloat16, torch.float32, torch.int32
D = 128  # the libraries' KDA head dim


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


def bound_to(signature: inspect.Signature, log: dict, name: str, reference):
    """A stub with `signature`: binds every call to it (TypeError on a name the real function does not take),
    fills in the real defaults, records the arguments and runs `reference` on them all as keywords."""
    def stub(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        log[name].append(dict(bound.arguments))
        with graph_standin.kernel((args, kwargs)):  # under a stand-in capture: a device kernel's own reads
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
            with graph_standin.kernel((args, kwargs)):
                return getattr(self.ref, method)(**{k: v for k, v in bound.arguments.items() if k != "self"})
    return Wrapper


def fla_fused_recurrent_kda_fwd(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state,
                                inplace_final_state, state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens,
                                use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                                allow_neg_eigval, lower_bound, out, **rest):
    """fla-core's in-place pool decode: one token per row, the row's state read and written at its slot."""
    _, T, H, K = q.shape
    for t in (q, k, v, g):
        assert t.shape == (1, T, H, K) and t.dtype == q.dtype
    assert beta.shape == (1, T, H) and A_log.shape == (H,) and dt_bias.numel() == H * K
    assert inplace_final_state and state_v_first and not output_final_state and num_accepted_tokens is None
    assert use_qk_l2norm_in_kernel and use_gate_in_kernel and use_beta_sigmoid_in_kernel and not allow_neg_eigval
    N = cu_seqlens.numel() - 1
    assert ssm_state_indices.shape == (N,) and ssm_state_indices.dtype == I32 and out is None
    assert initial_state.dim() == 4 and initial_state.shape[1:] == (H, K, K)
    gate = kda_gate(g[0].reshape(T, H * K), A_log, dt_bias.reshape(-1), K, lower_bound)
    b = torch.sigmoid(beta[0].float())
    o = torch.zeros(1, T, H, K, dtype=q.dtype)
    for n, (s, e) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        slot = int(ssm_state_indices[n])
        if e == s or slot < 0:
            continue
        y, S = kda_recurrent(l2norm(q[0, s:e]) * scale, l2norm(k[0, s:e]), v[0, s:e].float(), gate[s:e], b[s:e],
                             initial_state[slot])
        initial_state[slot] = S.to(initial_state.dtype)
        o[0, s:e] = y.to(q.dtype)
    return o, None


FLASH_KDA_SIGNATURE = inspect.signature(flash_kda_fwd)


def install(monkeypatch, libraries=("flashinfer", "flash_kda", "fla")) -> dict:
    """Replaces each installed library's entry points the glue calls by stubs bound to their real signatures
    (flash_kda: a module with the GPU build's signature); returns the call log {name: [arguments, ...]}."""
    log = defaultdict(list)
    if "flashinfer" in libraries:
        import flashinfer.kda
        import flashinfer.kda_decode
        import flashinfer.mla
        for module, name, reference in ((flashinfer.kda_decode, "fused_kda_decode", fused_kda_decode),
                                        (flashinfer.kda, "recurrent_kda", recurrent_kda),
                                        (flashinfer.mla, "trtllm_batch_decode_with_kv_cache_mla",
                                         trtllm_batch_decode_with_kv_cache_mla)):
            monkeypatch.setattr(module, name, bound_to(inspect.signature(getattr(module, name)), log, name, reference))
        monkeypatch.setattr(flashinfer.mla, "BatchMLAPagedAttentionWrapper",
                            bind_wrapper(flashinfer.mla.BatchMLAPagedAttentionWrapper, log))
    if "flash_kda" in libraries:
        flash_kda = types.ModuleType("flash_kda")
        flash_kda.fwd = bound_to(FLASH_KDA_SIGNATURE, log, "flash_kda", flash_kda_fwd)
        monkeypatch.setitem(sys.modules, "flash_kda", flash_kda)
    if "fla" in libraries:
        from fla.ops.kda import fused_recurrent
        name = "fused_recurrent_kda_fwd"
        monkeypatch.setattr(fused_recurrent, name, bound_to(inspect.signature(getattr(fused_recurrent, name)), log,
                                                            name, fla_fused_recurrent_kda_fwd))
    return log
