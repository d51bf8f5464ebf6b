"""The two torch forms of the KDA recurrence agree, and the conv state carries exactly."""
from __future__ import annotations

import pytest
import torch

from vllm.attention.kda.ops import causal_conv1d, kda_chunked, kda_gate, kda_recurrent, l2norm


def random_inputs(T: int, H: int = 3, K: int = 16, seed: int = 0, bounded: bool = True):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(T, H, K, generator=gen)) * K ** -0.5
    k = l2norm(torch.randn(T, H, K, generator=gen))
    v = torch.randn(T, H, K, generator=gen)
    raw = 2 * torch.randn(T, H * K, generator=gen)
    A_log = torch.rand(H, generator=gen) * 2
    dt_bias = torch.randn(H * K, generator=gen) * 0.5
    g = kda_gate(raw, A_log, dt_bias, K, -5.0 if bounded else None)
    beta = torch.rand(T, H, generator=gen)
    state = torch.randn(H, K, K, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 130])
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("bounded", [True, False])
def test_chunked_equals_recurrent(T, chunk_size, bounded):
    q, k, v, g, beta, state = random_inputs(T, seed=T + chunk_size, bounded=bounded)
    o_rec, s_rec = kda_recurrent(q, k, v, g, beta, state)
    o_chk, s_chk = kda_chunked(q, k, v, g, beta, state, chunk_size=chunk_size)
    torch.testing.assert_close(o_chk, o_rec, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s_chk, s_rec, rtol=1e-4, atol=1e-4)


def test_recurrent_step_matches_definition():
    """One token by the written-out formula: S' = S diag(e^g); c = b(v - S'k); S = S' + c k^T; o = S q."""
    q, k, v, g, beta, state = random_inputs(1, seed=11)
    o, s = kda_recurrent(q, k, v, g, beta, state)
    for h in range(q.shape[1]):
        S = state[h].double() @ torch.diag(g[0, h].double().exp())
        c = beta[0, h].double() * (v[0, h].double() - S @ k[0, h].double())
        S = S + torch.outer(c, k[0, h].double())
        torch.testing.assert_close(s[h].double(), S)
        torch.testing.assert_close(o[0, h].double(), S @ q[0, h].double())


def test_checkpoints_hold_the_state_after_each_token():
    q, k, v, g, beta, state = random_inputs(4, seed=5)
    ckpt = torch.empty(4, *state.shape)
    _, final = kda_recurrent(q, k, v, g, beta, state, checkpoints=ckpt)
    for t in range(4):
        _, s_t = kda_recurrent(q[:t + 1], k[:t + 1], v[:t + 1], g[:t + 1], beta[:t + 1], state)
        torch.testing.assert_close(ckpt[t], s_t)
    torch.testing.assert_close(ckpt[-1], final)


@pytest.mark.parametrize("split", [1, 2, 3, 7])
def test_conv_state_carries_across_chunks(split):
    gen = torch.Generator().manual_seed(split)
    x, w = torch.randn(10, 6, generator=gen), torch.randn(6, 4, generator=gen)
    whole, final = causal_conv1d(x, w, None)
    a, state = causal_conv1d(x[:split], w, None)
    b, state = causal_conv1d(x[split:], w, state)
    torch.testing.assert_close(torch.cat([a, b]), whole)
    torch.testing.assert_close(state, final)
    # Definition: out[t] = sum_j w[:, j] * x[t - (W-1) + j], zero before the start.
    padded = torch.cat([torch.zeros(3, 6), x])
    torch.testing.assert_close(whole[5], (w * padded[5:9].t()).sum(-1))
