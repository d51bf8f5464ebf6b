"""The torch reference KDA backend: conv-state update, gate, recurrence and gated RMSNorm over state pools.

Prompt chunks run the chunked form, decode rows the token-recurrent form; each reads its request's state
slot (zeros for a fresh request) and writes the final state back in the pool's dtype. A decode group of
one-token rows (the common case) runs as one batched step; other rows run one request at a time.
"""
from __future__ import annotations

import torch

from vllm.attention.kda.metadata import KDABackend, KDARows, KDAWeights, gated_norm
from vllm.attention.kda.ops import acc, causal_conv1d, kda_chunked, kda_gate, kda_recurrent, l2norm
from vllm.attention.kda.recover import KDARecords


class TorchKDABackend(KDABackend):
    name = "torch"
    runs_prefill = runs_decode = True
    decode_checkpoints = True

    decode_records = True

    @classmethod
    def forward_decode(cls, layer: KDAWeights, mixed_qkv: torch.Tensor, raw_gate: torch.Tensor,
                       raw_beta: torch.Tensor, output_gate: torch.Tensor, conv_state: torch.Tensor,
                       ssm_state: torch.Tensor, rows: KDARows, records: KDARecords | None = None) -> torch.Tensor:
        if rows.record:
            return cls._record_rows(layer, mixed_qkv, raw_gate, raw_beta, output_gate, conv_state, ssm_state, rows,
                                    records)
        lens = rows.query_start_loc_cpu[1:] - rows.query_start_loc_cpu[:-1]
        if bool((lens == 1).all()):
            return cls._one_token_rows(layer, mixed_qkv, raw_gate, raw_beta, output_gate, conv_state, ssm_state,
                                       rows)
        return cls._per_request(layer, mixed_qkv, raw_gate, raw_beta, output_gate, conv_state, ssm_state, rows,
                                kda_recurrent)

    @classmethod
    def forward_prefill(cls, layer: KDAWeights, mixed_qkv: torch.Tensor, raw_gate: torch.Tensor,
                        raw_beta: torch.Tensor, output_gate: torch.Tensor, conv_state: torch.Tensor,
                        ssm_state: torch.Tensor, rows: KDARows) -> torch.Tensor:
        return cls._per_request(layer, mixed_qkv, raw_gate, raw_beta, output_gate, conv_state, ssm_state, rows,
                                kda_chunked)

    @staticmethod
    def _one_token_rows(layer, mixed_qkv, raw_gate, raw_beta, output_gate, conv_state, ssm_state, rows):
        H, K = layer.num_heads, layer.head_dim
        T = rows.num_tokens
        src = dst = rows.state_indices.long()
        if rows.checkpointed:  # read the last kept token's column, write the one token's state to column 0
            src = dst.gather(1, (rows.num_accepted_tokens.long() - 1)[:, None]).squeeze(1)
            dst = dst[:, 0]
        x = mixed_qkv[:T]
        window = torch.cat([conv_state[src], x[:, :, None].to(conv_state.dtype)], dim=-1)
        conv_state[dst] = window[..., 1:]
        q, k, v = _qkv((acc(window) * acc(layer.conv_weight)).sum(-1), mixed_qkv.dtype, H, K)
        g = kda_gate(raw_gate[:T], layer.A_log, layer.dt_bias, K, layer.gate_lower_bound)
        beta = torch.sigmoid(acc(raw_beta[:T]))
        # Requests are independent, so N requests x H heads run as N*H heads of one recurrent step.
        o, S = kda_recurrent(q.reshape(1, T * H, K), k.reshape(1, T * H, K), v.reshape(1, T * H, K),
                             g.reshape(1, T * H, K), beta.reshape(1, T * H), ssm_state[src].reshape(T * H, K, K))
        ssm_state[dst] = S.view(T, H, K, K).to(ssm_state.dtype)
        return gated_norm(layer, o.view(T, H, K), output_gate[:T], mixed_qkv.dtype)

    @staticmethod
    def _record_rows(layer, mixed_qkv, raw_gate, raw_beta, output_gate, conv_state, ssm_state, rows, records):
        """RecoverSSM's verify: every row from its slot's state, padded to the record length Q and run as one
        sequence of N*H heads; the pools are read, never written; each token's correction, key, decay and input
        go to the slot's records (recover.py)."""
        H, K, Q = layer.num_heads, layer.head_dim, records.record_len
        T, N = rows.num_tokens, rows.num_reqs
        qsl = rows.query_start_loc.long()
        valid = torch.arange(Q, device=qsl.device) < (qsl[1:] - qsl[:-1])[:, None]  # [N, Q]
        tok = torch.where(valid, qsl[:-1, None] + torch.arange(Q, device=qsl.device), 0)
        src = rows.state_indices.long().clamp(min=0)
        x = mixed_qkv[tok] * valid[..., None]  # [N, Q, C], padding zero
        window = torch.cat([conv_state[src], x.transpose(1, 2).to(conv_state.dtype)], dim=-1)  # [N, C, W-1+Q]
        conv_out = (acc(window).unfold(-1, layer.conv_weight.shape[1], 1) * acc(layer.conv_weight)[:, None]).sum(-1)
        q, k, v = _qkv(conv_out.transpose(1, 2).contiguous(), mixed_qkv.dtype, H, K)  # [N, Q, H, K]
        g = kda_gate(raw_gate[tok], layer.A_log, layer.dt_bias, K, layer.gate_lower_bound)
        beta = torch.sigmoid(acc(raw_beta[tok]))

        def seq(t: torch.Tensor) -> torch.Tensor:  # [N, Q, H, ...] -> [Q, N*H, ...]
            return t.transpose(0, 1).reshape(Q, N * H, *t.shape[3:])

        corrections, decays = acc(q.new_empty(2, Q, N * H, K))
        o, _ = kda_recurrent(seq(q), seq(k), seq(v), seq(g), seq(beta), ssm_state[src].reshape(N * H, K, K),
                             corrections=corrections, decays=decays)
        records.c[src] = corrections.view(Q, N, H, K).permute(1, 2, 0, 3)
        records.kd[src] = torch.stack([k, decays.view(Q, N, H, K).transpose(0, 1)], dim=3).transpose(1, 2)
        records.x[src] = x.to(records.x.dtype)
        core = acc(mixed_qkv.new_zeros(T, H, K))
        core[tok[valid]] = o.view(Q, N, H, K).transpose(0, 1)[valid]
        return gated_norm(layer, core, output_gate[:T], mixed_qkv.dtype)

    @staticmethod
    def _per_request(layer, mixed_qkv, raw_gate, raw_beta, output_gate, conv_state, ssm_state, rows, kda):
        H, K = layer.num_heads, layer.head_dim
        T = rows.num_tokens
        g = kda_gate(raw_gate[:T], layer.A_log, layer.dt_bias, K, layer.gate_lower_bound)
        beta = torch.sigmoid(acc(raw_beta[:T]))
        core = acc(mixed_qkv.new_zeros(T, H, K))
        qsl = rows.query_start_loc_cpu.tolist()
        accepted = rows.num_accepted_tokens.tolist() if rows.checkpointed else [1] * rows.num_reqs
        for r, (slot, has_init) in enumerate(zip(rows.state_indices_cpu.tolist(),
                                                 rows.has_initial_state_cpu.tolist())):
            s, e = qsl[r], qsl[r + 1]
            cols = slot if rows.checkpointed else [slot]
            src = cols[accepted[r] - 1]
            if e == s or src < 0:
                continue
            conv_out, final_conv = causal_conv1d(mixed_qkv[s:e], layer.conv_weight,
                                                 conv_state[src] if has_init else None)
            q, k, v = _qkv(conv_out, mixed_qkv.dtype, H, K)
            state = ssm_state[src] if has_init else acc(torch.zeros_like(ssm_state[src]))
            if not rows.checkpointed:
                core[s:e], final = kda(q, k, v, g[s:e], beta[s:e], state)
                conv_state[src], ssm_state[src] = final_conv, final.to(ssm_state.dtype)
                continue
            # Checkpoint columns: the state after token t goes to column t (kda_recurrent's checkpoints).
            states = acc(q.new_empty(e - s, *ssm_state.shape[1:]))
            core[s:e], _ = kda_recurrent(q, k, v, g[s:e], beta[s:e], state, checkpoints=states)
            history = conv_state[src].t() if has_init else mixed_qkv.new_zeros(layer.conv_weight.shape[1] - 1,
                                                                                mixed_qkv.shape[1])
            inputs = torch.cat([history.to(conv_state.dtype), mixed_qkv[s:e].to(conv_state.dtype)])
            width = layer.conv_weight.shape[1]
            for t in range(e - s):  # inputs and states are copies: overwriting src, one of the columns, is safe
                conv_state[cols[t]], ssm_state[cols[t]] = inputs[t + 1:t + width].t(), states[t].to(ssm_state.dtype)
        return gated_norm(layer, core, output_gate[:T], mixed_qkv.dtype)


def _qkv(conv_out: torch.Tensor, act_dtype: torch.dtype, H: int, K: int):
    """SiLU, then q, k, v [.., H, K] in float32 with q and k l2-normalised (q also scaled by K^-1/2)."""
    # Round like the activations a kernel would store, so that bf16 runs match kernels.
    qkv = acc(torch.nn.functional.silu(conv_out).to(act_dtype))
    q, k, v = (x.unflatten(-1, (H, K)) for x in qkv.chunk(3, dim=-1))
    return l2norm(q) * K ** -0.5, l2norm(k), v
