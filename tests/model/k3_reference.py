"""Float64 references for the Kimi-K3 / Kimi-Linear model, transcribed from kimi_k3_model.md (shared docs).

Plain torch over the model's weights: no helper of the model code is used, so a test that compares the engine
with these formulas compares it with the doc. Per-module formulas (sections 2-5) and `ref_logits`, the whole
model composed from them.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def lin(x, module):
    return x @ module.weight.double().t()


def rms(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def situ(g, u):
    """SiTU-GLU (§5): 4 tanh(g/4) sigmoid(g) * 25 tanh(u/25)."""
    return 4 * torch.tanh(g / 4) * torch.sigmoid(g) * (25 * torch.tanh(u / 25))


def ref_gate(f, A_log, dt_bias, K, lower_bound):
    """§3 gate: s = f + dt_bias; bounded g = lb sigmoid(a_h s), else g = -a_h softplus(s) (linear above 20)."""
    s = (f.double() + dt_bias.double()).unflatten(-1, (-1, K))
    a = A_log.double().exp()[:, None]
    if lower_bound is None:
        return -a * torch.where(s > 20, s, torch.log1p(torch.exp(s)))
    return lower_bound * torch.sigmoid(a * s)


def ref_kda_layer(attn, x, cfg):
    """§3 KDA layer for one sequence from a fresh state (zero conv history, S = 0)."""
    T, H, K = x.shape[0], attn.num_heads, attn.head_dim
    qkv = torch.cat([lin(x, attn.q_proj), lin(x, attn.k_proj), lin(x, attn.v_proj)], dim=-1)  # [T, 3P]
    w = torch.cat([attn.q_conv1d.weight, attn.k_conv1d.weight, attn.v_conv1d.weight]).double()  # [3P, W]
    W = w.shape[1]
    padded = F.pad(qkv, (0, 0, W - 1, 0))  # u_t = silu(sum_j w[:, j] x_{t-W+1+j})
    u = F.silu(sum(w[:, j] * padded[j:j + T] for j in range(W)))
    q, k, v = u.unflatten(-1, (3, H, K)).unbind(1)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * K ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    g = ref_gate(lin(lin(x, attn.f_a_proj), attn.f_b_proj), attn.A_log, attn.dt_bias, K, cfg.gate_lower_bound)
    beta = torch.sigmoid(lin(x, attn.b_proj))
    S = torch.zeros(H, K, K, dtype=torch.float64)  # [H, V, K]
    o = []
    for t in range(T):
        S = S * g[t].exp()[:, None, :]
        c = beta[t][:, None] * (v[t] - torch.einsum("hvk,hk->hv", S, k[t]))
        S = S + c[:, :, None] * k[t][:, None, :]
        o.append(torch.einsum("hvk,hk->hv", S, q[t]))
    z = lin(x, attn.g_proj) if cfg.use_full_rank_gate else lin(lin(x, attn.g_a_proj), attn.g_b_proj)
    y = rms(torch.stack(o), attn.o_norm.weight, cfg.rms_norm_eps) * torch.sigmoid(z.unflatten(-1, (H, K)))
    return lin(y.flatten(-2), attn.o_proj)


def ref_mla_layer(attn, x, cfg):
    """§4 NoPE MLA: causal softmax of (q_n.k_n + q_r.k_r)/sqrt(nope+rope), then o * sigmoid(g_proj x), o_proj."""
    eps, H, T = cfg.rms_norm_eps, cfg.num_attention_heads, x.shape[0]
    nope, rope, vd, L = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    q = lin(rms(lin(x, attn.q_a_proj), attn.q_a_layernorm.weight, eps), attn.q_b_proj).view(T, H, nope + rope)
    c_kv, k_r = lin(x, attn.kv_a_proj_with_mqa).split([L, rope], dim=-1)
    k_n, v = lin(rms(c_kv, attn.kv_a_layernorm.weight, eps), attn.kv_b_proj).view(T, H, nope + vd).split(
        [nope, vd], dim=-1)
    scores = (torch.einsum("thn,shn->hts", q[..., :nope], k_n)
              + torch.einsum("thr,sr->hts", q[..., nope:], k_r)) / math.sqrt(nope + rope)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    o = torch.einsum("hts,shv->thv", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)
    if cfg.mla_use_output_gate:
        o = o * torch.sigmoid(lin(x, attn.g_proj)).view(T, H, vd)
    return lin(o.flatten(-2), attn.o_proj)


def ref_attn_res(P, R, n, norm_w, proj_w, eps):
    """§2 AttnRes mixture over sources R[0..n-1], P: softmax of (w_n*w_q).x/rms(x), sum of unnormalised x."""
    X = torch.stack(R[:n] + [P])  # [n+1, T, D]
    logits = (X / torch.sqrt(X.pow(2).mean(-1, keepdim=True) + eps)) @ (norm_w.double() * proj_w.double().view(-1))
    return (logits.softmax(0)[..., None] * X).sum(0)


def ref_route(moe, x, cfg):
    """§5 router: top-k of sigmoid scores plus the correction bias (selection in fp32, as the model routes),
    weights = the selected unbiased scores, renormalised, times routed_scaling_factor."""
    s32 = torch.sigmoid(x.float() @ moe.gate.weight.float().t())
    ids = (s32 + moe.gate.e_score_correction_bias.float()).topk(cfg.num_experts_per_token, dim=-1).indices
    weights = torch.sigmoid(lin(x, moe.gate)).gather(1, ids)
    return ids, weights / weights.sum(-1, keepdim=True) * cfg.routed_scaling_factor


def ref_latent_moe(moe, x, cfg):
    """§5: experts in the latent space (down-projection, experts, RMSNorm, up-projection) plus the shared
    experts on the un-projected x."""
    ids, weights = ref_route(moe, x, cfg)
    u = lin(x, moe.routed_expert_down_proj)
    y_lat = torch.zeros(x.shape[0], cfg.routed_expert_hidden_size, dtype=torch.float64)
    for e, ex in enumerate(moe.experts):
        w_e = (weights * (ids == e)).sum(-1, keepdim=True)  # 0 for tokens not routed to e
        y_lat += w_e * lin(situ(lin(u, ex.w1), lin(u, ex.w3)), ex.w2)
    return lin(rms(y_lat, moe.routed_expert_norm.weight, cfg.rms_norm_eps), moe.routed_expert_up_proj) \
        + ref_dense_mlp(moe.shared_experts, x)


def ref_dense_mlp(mlp, x):
    """§5 dense FFN: down(SiTU-GLU(gate x, up x))."""
    return lin(situ(lin(x, mlp.gate_proj), lin(x, mlp.up_proj)), mlp.down_proj)


def ref_logits(model, tokens: list[int]) -> torch.Tensor:
    """§2 the whole K3 model (SiTU, latent MoE, Block AttnRes) on one sequence from empty caches: [T, vocab]."""
    cfg, m = model.config, model.model
    assert cfg.hidden_act == "situ" and cfg.routed_expert_hidden_size and cfg.attn_res_block_size, \
        "this reference transcribes the K3 switches the built-in model uses"
    B, L, eps = cfg.attn_res_block_size, cfg.num_hidden_layers, cfg.rms_norm_eps
    nb = -(-L // B)
    P, R, delta = m.embed_tokens.weight.double()[tokens], [None] * nb, None
    for i, layer in enumerate(m.layers):
        w, n = int(i % B == 0), -(-i // B)
        if delta is not None:
            P = P + delta
        if w:
            R[i // B] = P
        x_a = rms(ref_attn_res(P, R, n, layer.self_attention_res_norm.weight, layer.self_attention_res_proj.weight,
                               eps), layer.input_layernorm.weight, eps)
        a = (ref_kda_layer if layer.is_kda else ref_mla_layer)(layer.self_attn, x_a, cfg)
        P, delta = (a, None) if w else (P, a)
        if delta is not None:
            P = P + delta
        x_m = rms(ref_attn_res(P, R, n + w, layer.mlp_res_norm.weight, layer.mlp_res_proj.weight, eps),
                  layer.post_attention_layernorm.weight, eps)
        moe = getattr(layer, "block_sparse_moe", None)
        delta = ref_latent_moe(moe, x_m, cfg) if moe is not None else ref_dense_mlp(layer.mlp, x_m)
    h = ref_attn_res(P + delta, R, nb, m.output_attn_res_norm.weight, m.output_attn_res_proj.weight, eps)
    return lin(rms(h, m.norm.weight, eps), model.lm_head)
