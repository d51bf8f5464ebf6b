"""KDA math in plain torch, float32: the reference every KDA kernel is tested against.

State layout is the engine's: S[h] is [V, K] (HF and fla keep the transpose [K, V]). One step is
    S' = S diag(exp g_t);  c_t = beta_t (v_t - S' k_t);  S_t = S' + c_t k_t^T;  o_t = S_t q_t.
Two forms: token-recurrent (decode) and chunked (prefill); they agree to rounding.
"""
import torch
import torch.nn.functional as F

SOFTPLUS_LINEAR_ABOVE = 20.0  # softplus(x) is taken as x above this, as the published kernels do


def acc(x: torch.Tensor) -> torch.Tensor:
    """x in the accumulation dtype: float32, or float64 when a test asks for a float64 reference."""
    return x if x.dtype == torch.float64 else x.float()


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # sqrt(sum + eps), not F.normalize's max(norm, eps): the published kernels do this.
    x = acc(x)
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_gate(raw_gate: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, head_dim: int,
             lower_bound: float | None) -> torch.Tensor:
    """Per-channel log forget gate g [T, H, K] from f_b_proj's output [T, H*K].

    Kimi-Linear: g = -exp(A_log) * softplus(f + dt_bias).  K3 (bounded): g = lb * sigmoid(exp(A_log) * (f + dt_bias)).
    """
    s = (acc(raw_gate) + acc(dt_bias)).unflatten(-1, (-1, head_dim))
    a = acc(A_log).exp()[:, None]
    if lower_bound is None:
        softplus = torch.where(s > SOFTPLUS_LINEAR_ABOVE, s, F.softplus(s))
        return -a * softplus
    return lower_bound * torch.sigmoid(a * s)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of x [T, C] with weight [C, W], continuing from conv_state [C, W-1].

    Returns the conv output [T, C] in float32 (no activation) and the new state: the last W-1 inputs.
    A None state means a fresh sequence (zero history).
    """
    width = weight.shape[-1]
    if conv_state is None:
        conv_state = x.new_zeros(x.shape[1], width - 1)
    full = acc(torch.cat([conv_state.to(x.dtype).t(), x], dim=0))
    out = (full.unfold(0, width, 1) * acc(weight)).sum(-1)
    return out, full[full.shape[0] - (width - 1):].t()


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, checkpoints: torch.Tensor | None = None,
                  corrections: torch.Tensor | None = None, decays: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token KDA for one sequence.

    q, k [T, H, K] (q already scaled), v [T, H, V], g [T, H, K], beta [T, H], state [H, V, K].
    If `checkpoints` [T, H, V, K] is given, the state after token t is also written to checkpoints[t]
    (the speculative-decoding layout); if `corrections` [T, H, V] is given, token t's correction c_t goes to
    corrections[t] and its decay exp(g_t) [T, H, K] to decays[t] (RecoverSSM's records, recover.py). Returns
    o [T, H, V] and the final state, float32.
    """
    S = acc(state)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1], dtype=S.dtype)
    for t in range(q.shape[0]):
        d = g[t].exp()
        S = S * d[:, None, :]
        c = beta[t, :, None] * (v[t] - torch.einsum("hvk,hk->hv", S, k[t]))
        S = S + c[:, :, None] * k[t][:, None, :]
        out[t] = torch.einsum("hvk,hk->hv", S, q[t])
        if checkpoints is not None:
            checkpoints[t] = S
        if corrections is not None:
            corrections[t], decays[t] = c, d
    return out, S


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA for one sequence (same contract as kda_recurrent, without checkpoints).

    Inside a chunk with cumulative log-decay G_t, the per-token updates u_t solve the unit lower-triangular
    system (I + A) U = beta * (V - (K * e^G) S0^T), with A[t, s] = beta_t sum_c k_tc k_sc e^(G_tc - G_sc), s < t.
    Then o = (Q * e^G) S0^T + Mask_incl(Q K^T-decayed) U and S_C = S0 e^(G_C) + sum_s u_s (k_s e^(G_C - G_s))^T.
    """
    q, k, v, g, beta = (acc(x).transpose(0, 1) for x in (q, k, v, g, beta))  # heads first
    S = acc(state)
    T = q.shape[1]
    out = torch.empty_like(v)
    for start in range(0, T, chunk_size):
        sl = slice(start, min(start + chunk_size, T))
        qc, kc, vc, bc = q[:, sl], k[:, sl], v[:, sl], beta[:, sl]
        G = g[:, sl].cumsum(1)
        C = qc.shape[1]
        diff = G[:, :, None, :] - G[:, None, :, :]  # [H, t, s, K]
        incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        decay = diff.masked_fill(~incl[None, :, :, None], float("-inf")).exp()
        kk = torch.einsum("htc,hsc,htsc->hts", kc, kc, decay)
        A = (bc[:, :, None] * kk).tril(-1)
        rhs = bc[..., None] * (vc - torch.einsum("htk,hvk->htv", kc * G.exp(), S))
        eye = torch.eye(C, device=q.device, dtype=S.dtype)
        U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        qk = torch.einsum("htc,hsc,htsc->hts", qc, kc, decay)
        out[:, sl] = torch.einsum("htk,hvk->htv", qc * G.exp(), S) + qk @ U
        G_last = G[:, -1:]
        S = S * G_last.exp() + torch.einsum("hsv,hsk->hvk", U, kc * (G_last - G).exp())
    return out.transpose(0, 1), S
