"""RecoverSSM (`--use-replayssm`): one KDA state per speculating request instead of 1 + K checkpoint columns.

A verify row runs its tokens from the request's state S0 without writing it back. For each token t it records
what the recurrence added: the correction c_t = beta_t (v_t - S' k_t) [H, V] (S' the decayed state before t), the
l2-normalised key k_t and the decay d_t = exp(g_t) [H, K], and its pre-conv input x_t [3P]. After sampling, one
commit launch over every layer advances S0 by the row's n accepted tokens (the anchor and the drafts kept):
S_t = S_{t-1} diag(d_t) + c_t k_t^T, the same floating-point operations the verify ran, so the state equals the
checkpoint column it replaces bit for bit; the conv window moves n inputs along. A commit may also leave the state
after m <= n tokens in a prefix-caching snapshot slot. Pools are stacked over the KDA layers ([L, slots, ...]),
so the commit is one launch and a snapshot copy one index_copy_ per pool.

Records are kept in float32 (k and d included, rather than the raw activations): the commit then repeats the
verify's arithmetic exactly instead of recomputing the gate and the norm.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class KDARecords:
    """Per-token verify records, slots after the leading layer dim when stacked ([L, slots, ...]) or first."""
    c: torch.Tensor  # [slots, H, Q, V] float32 corrections
    kd: torch.Tensor  # [slots, H, Q, 2, K] float32: normalised key, decay
    x: torch.Tensor  # [slots, Q, 3P] pre-conv inputs, in the conv state's dtype

    @property
    def record_len(self) -> int:
        return self.x.shape[-2]

    def layer(self, i: int) -> KDARecords:
        return KDARecords(self.c[i], self.kd[i], self.x[i])


def record_bytes(num_heads: int, head_dim: int, conv_channels: int, record_len: int, conv_dtype: torch.dtype) -> int:
    """One slot's records in one layer."""
    H, K, Q = num_heads, head_dim, record_len
    return H * Q * K * 4 + H * Q * 2 * K * 4 + Q * conv_channels * torch.empty((), dtype=conv_dtype).element_size()


def allocate_records(num_layers: int, num_slots: int, num_heads: int, head_dim: int, conv_channels: int,
                     record_len: int, conv_dtype: torch.dtype, device: torch.device | str) -> KDARecords:
    L, H, K, Q = num_layers, num_heads, head_dim, record_len
    return KDARecords(c=torch.zeros(L, num_slots, H, Q, K, dtype=torch.float32, device=device),
                      kd=torch.zeros(L, num_slots, H, Q, 2, K, dtype=torch.float32, device=device),
                      x=torch.zeros(L, num_slots, Q, conv_channels, dtype=conv_dtype, device=device))


def commit(conv_state: torch.Tensor, ssm_state: torch.Tensor, records: KDARecords, slots: torch.Tensor,
           counts: torch.Tensor, snap_slots: torch.Tensor | None = None,
           snap_counts: torch.Tensor | None = None) -> None:
    """Advances each row's state by its first counts[r] recorded tokens, in place, over every layer.

    conv_state [L, slots, 3P, W-1] (either layout), ssm_state [L, slots, H, V, K], records stacked the same way;
    slots, counts device int [N] (count 0: the row is not committed, e.g. a prompt chunk, which wrote its state
    itself). snap_slots/snap_counts [N]: where >= 0, the state after snap_counts[r] (1..counts[r]) tokens also goes
    to snapshot slot snap_slots[r]. Triton on CUDA, torch elsewhere; no host sync either way."""
    if slots.numel() == 0:
        return
    if ssm_state.is_cuda:
        from vllm.attention.kda.recover_kernel import commit_triton
        commit_triton(conv_state, ssm_state, records, slots, counts, snap_slots, snap_counts)
    else:
        commit_torch(conv_state, ssm_state, records, slots, counts, snap_slots, snap_counts)


def commit_torch(conv_state: torch.Tensor, ssm_state: torch.Tensor, records: KDARecords, slots: torch.Tensor,
                 counts: torch.Tensor, snap_slots: torch.Tensor | None = None,
                 snap_counts: torch.Tensor | None = None) -> None:
    """`commit` in torch: the reference, and the CPU path. Rows with count 0 read and rewrite their own state
    unchanged (fixed shapes, no sync); a count past the record length is clipped to it."""
    idx = slots.long()
    n = counts.long().clamp(0, records.record_len)
    S0 = ssm_state[:, idx]
    S = S0.float() if S0.dtype != torch.float64 else S0
    c, kd = records.c[:, idx], records.kd[:, idx]  # [L, N, H, Q, V], [L, N, H, Q, 2, K]
    snap_at = snap_counts.long().clamp(0, records.record_len) if snap_slots is not None else None
    snap_S = torch.zeros_like(S) if snap_at is not None else None
    for t in range(records.record_len):
        k, d = kd[:, :, :, t, 0], kd[:, :, :, t, 1]  # [L, N, H, K]
        # The verify's operations in its order: decay, then add the correction's outer product.
        step = S * d[..., None, :]
        step = step + c[:, :, :, t, :, None] * k[..., None, :]
        S = torch.where((t < n)[None, :, None, None, None], step, S)
        if snap_S is not None:
            snap_S = torch.where((snap_at == t + 1)[None, :, None, None, None], S, snap_S)
    ssm_state[:, idx] = torch.where((n > 0)[None, :, None, None, None], S.to(ssm_state.dtype), S0)
    # The conv window after n tokens: the last W-1 of [old window, x_1..x_n].
    window = conv_state[:, idx]  # [L, N, C, W-1]
    Wm1 = window.shape[-1]
    joined = torch.cat([window, records.x[:, idx].transpose(-1, -2).to(window.dtype)], dim=-1)
    cols = (n[:, None] + torch.arange(Wm1, device=n.device))  # [N, W-1]
    conv_state[:, idx] = joined.gather(-1, cols[None, :, None, :].expand(*window.shape))
    if snap_S is not None:
        take = (snap_slots >= 0) & (snap_at >= 1) & (snap_at <= n)
        dst = torch.where(take, snap_slots.long(), idx)  # rows without a snapshot rewrite their own new state
        snap_cols = (snap_at.clamp(min=0)[:, None] + torch.arange(Wm1, device=n.device))
        snap_window = joined.gather(-1, snap_cols[None, :, None, :].expand(*window.shape))
        keep = take[None, :, None, None]
        ssm_state[:, dst] = torch.where(keep[..., None], snap_S.to(ssm_state.dtype), ssm_state[:, dst])
        conv_state[:, dst] = torch.where(keep, snap_window, conv_state[:, dst])
