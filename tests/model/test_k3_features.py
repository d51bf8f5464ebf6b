"""The K3-only model features, each checked against a reference written from kimi_k3_model.md (shared docs).

The references (k3_reference.py) are plain torch (float64) transcriptions of the formulas in sections 2-5; they
use no helper of the model code. Model modules appear only as black boxes (their weights and their outputs).
"""
from __future__ import annotations

import pytest
import torch
from k3_reference import (lin, ref_attn_res, ref_dense_mlp, ref_gate, ref_kda_layer, ref_latent_moe, ref_mla_layer,
                          ref_route, rms, situ)
from sequence_runner import SequenceRunner

from vllm.attention.kda.ops import kda_gate
from vllm.model_executor.layers.activation import situ_and_mul
from vllm.model_executor.model_loader import load_model
from vllm.tools.make_tiny_model import random_state_dict, tiny_text_config, wrap_k3, write_checkpoint

# A non-unit scale makes the routed_scaling_factor observable (the tool's default is 1.0).
K3_OVERRIDES = dict(routed_scaling_factor=2.5)
K3_B4_OVERRIDES = dict(num_hidden_layers=5, attn_res_block_size=4, linear_attn_config={
    "kda_layers": [1, 2, 3, 5], "full_attn_layers": [4], "head_dim": 16, "num_heads": 4,
    "short_conv_kernel_size": 4, "use_full_rank_gate": True, "gate_lower_bound": -5.0})


def build(tmp_path_factory, family: str, seed: int = 0, **overrides):
    text = tiny_text_config(family, **overrides)
    config = wrap_k3(text) if family == "k3" else text
    out = tmp_path_factory.mktemp(family)
    write_checkpoint(out, config, random_state_dict(config, seed=seed))
    return load_model(out, "float32")


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    return build(tmp_path_factory, "k3", **K3_OVERRIDES)


@pytest.fixture(scope="module")
def k3_b4(tmp_path_factory):
    return build(tmp_path_factory, "k3", seed=1, **K3_OVERRIDES, **K3_B4_OVERRIDES)


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory):
    return build(tmp_path_factory, "kimi_linear")


def run_capturing(model, modules: dict, num_tokens: int, seed: int):
    """forward_whole on random tokens; records (input, output) in float64 of every module in `modules`."""
    records = {}

    def hook(key):
        return lambda mod, args, out: records.__setitem__(key, (args[0].double(), out.double()))

    def recording_output(key, output):
        """An attention mixer's last part, output(y, x), sees the mixer's input x and makes its output: the
        forward in pieces (KimiK3Model.begin/between/end) never calls the mixer module itself."""
        def output_and_record(y, x):
            out = output(y, x)
            records[key] = (x.double(), out.double())
            return out
        return output_and_record

    mixers = {key: m for key, m in modules.items() if hasattr(m, "project")}
    handles = [m.register_forward_hook(hook(key)) for key, m in modules.items() if key not in mixers]
    for key, m in mixers.items():
        m.output = recording_output(key, m.output)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, model.config.vocab_size, (num_tokens,), generator=gen).tolist()
    try:
        logits = SequenceRunner(model, max_model_len=128).forward_whole(tokens)
    finally:
        for h in handles:
            h.remove()
        for m in mixers.values():
            del m.output  # the instance attribute: the class's method again
    return logits.double(), records, tokens


def assert_close(actual, expected, rtol=1e-5):
    """Relative agreement, scaled by the reference's magnitude."""
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=rtol * expected.abs().max().item())


# ---- 1. KDA forget gate ------------------------------------------------------------------------------
@pytest.mark.parametrize("lower_bound", [-5.0, -1.5])
def test_bounded_gate(lower_bound):
    """K3 §3: g = lb * sigmoid(exp(A_log_h) * (f + dt_bias)), per head h, inside (lb, 0)."""
    torch.manual_seed(1)
    T, H, K = 7, 4, 16
    raw, dt_bias = 1.5 * torch.randn(T, H * K), 0.5 * torch.randn(H * K)
    A_log = torch.empty(H).uniform_(-1.0, 0.7)
    g = kda_gate(raw, A_log, dt_bias, K, lower_bound)
    assert g.shape == (T, H, K)
    assert_close(g, ref_gate(raw, A_log, dt_bias, K, lower_bound))
    assert ((g > lower_bound) & (g < 0)).all()
    assert g.min() < 0.9 * lower_bound and g.max() > 0.1 * lower_bound  # the inputs span the range


def test_softplus_gate():
    """Kimi-Linear §3: g = -exp(A_log_h) * softplus(f + dt_bias), softplus(s) = s for s > 20; g < 0."""
    torch.manual_seed(2)
    T, H, K = 5, 4, 16
    A_log, dt_bias = torch.empty(H).uniform_(-1.0, 1.5), 0.5 * torch.randn(H * K)
    raw = 3 * torch.randn(T, H * K)
    raw[0] = torch.linspace(-30, 45, H * K) - dt_bias  # s sweeps the tail and the linear region
    g = kda_gate(raw, A_log, dt_bias, K, None)
    assert_close(g, ref_gate(raw, A_log, dt_bias, K, None))
    assert (g < 0).all()
    s0 = (raw[0] + dt_bias).double().view(H, K)
    linear = s0 > 20
    assert linear.any()
    torch.testing.assert_close(g[0][linear].double(), (-A_log.double().exp()[:, None] * s0)[linear], rtol=1e-6,
                               atol=0)


# ---- 2. KDA layer with the full-rank output gate -----------------------------------------------------
def test_kda_layer_full_rank_gate(k3):
    """§3: conv + SiLU, l2norm, bounded gate, delta rule, RMSNorm * o_norm * sigmoid(g_proj x), o_proj."""
    cfg, idx = k3.config, 1
    layer = k3.model.layers[idx]
    assert layer.is_kda and cfg.gate_lower_bound == -5.0
    P = cfg.kda_num_heads * cfg.kda_head_dim
    assert layer.self_attn.g_proj.weight.shape == (P, cfg.hidden_size)
    assert not hasattr(layer.self_attn, "g_a_proj")
    # 70 tokens: more than one 64-token chunk of the model's prefill form.
    _, rec, _ = run_capturing(k3, {"attn": layer.self_attn}, num_tokens=70, seed=3)
    x, out = rec["attn"]
    assert_close(out, ref_kda_layer(layer.self_attn, x, cfg))


# ---- 3. MLA with the output gate ----------------------------------------------------------------------
def test_mla_output_gate(k3):
    """§4: NoPE MLA, causal softmax of (q_n.k_n + q_r.k_r)/sqrt(nope+rope), then o * sigmoid(g_proj x), o_proj."""
    cfg, idx = k3.config, 3
    attn = k3.model.layers[idx].self_attn
    assert not k3.model.layers[idx].is_kda and cfg.mla_latent_norm_eps is None
    H, vd = cfg.num_attention_heads, cfg.v_head_dim
    assert attn.g_proj.weight.shape == (H * vd, cfg.hidden_size)
    _, rec, _ = run_capturing(k3, {"attn": attn}, num_tokens=12, seed=4)
    x, out = rec["attn"]
    assert_close(out, ref_mla_layer(attn, x, cfg))


# ---- 4. Block AttnRes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["k3", "k3_b4"])
def test_block_attn_res(name, request):
    """§2 residual stream: the mixer/MLP inputs and the logits follow from the recorded sublayer outputs."""
    model = request.getfixturevalue(name)
    cfg, m = model.config, model.model
    B, L, eps = cfg.attn_res_block_size, cfg.num_hidden_layers, cfg.rms_norm_eps
    assert (B, L) in [(2, 6), (4, 5)]
    modules = {}
    for i, layer in enumerate(m.layers):
        modules[("mix", i)] = layer.self_attn
        modules[("ffn", i)] = layer.block_sparse_moe if hasattr(layer, "block_sparse_moe") else layer.mlp
    logits, rec, tokens = run_capturing(model, modules, num_tokens=10, seed=5)

    nb = -(-L // B)
    P, R, delta = m.embed_tokens.weight.double()[tokens], [None] * nb, None
    for l, layer in enumerate(m.layers):
        w, n = int(l % B == 0), -(-l // B)
        if delta is not None:
            P = P + delta
        if w:
            R[l // B] = P
        x_a = ref_attn_res(P, R, n, layer.self_attention_res_norm.weight, layer.self_attention_res_proj.weight, eps)
        assert_close(rec[("mix", l)][0], rms(x_a, layer.input_layernorm.weight, eps))
        a = rec[("mix", l)][1]
        P, delta = (a, None) if w else (P, a)
        if delta is not None:
            P = P + delta
        x_m = ref_attn_res(P, R, n + w, layer.mlp_res_norm.weight, layer.mlp_res_proj.weight, eps)
        assert_close(rec[("ffn", l)][0], rms(x_m, layer.post_attention_layernorm.weight, eps))
        delta = rec[("ffn", l)][1]
    h = ref_attn_res(P + delta, R, nb, m.output_attn_res_norm.weight, m.output_attn_res_proj.weight, eps)
    assert_close(logits, lin(rms(h, m.norm.weight, eps), model.lm_head))


# ---- 5. Latent MoE ------------------------------------------------------------------------------------
def test_latent_moe(k3):
    """§5: sigmoid router, top-k by s + bias, renormalised s * scale; experts in the latent space, RMSNorm,
    up-projection, plus shared experts on the un-projected x."""
    cfg = k3.config
    moe = k3.model.layers[1].block_sparse_moe
    D, R, k = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.num_experts_per_token
    assert moe.routed_expert_down_proj.weight.shape == (R, D) and moe.experts[0].w1.weight.shape[1] == R
    torch.manual_seed(6)
    x = torch.randn(64, D)
    with torch.inference_mode():
        y = moe(x)

    ids, _ = ref_route(moe, x.double(), cfg)
    unbiased = torch.sigmoid(x @ moe.gate.weight.float().t()).topk(k, dim=-1).indices
    assert (ids.sort(-1).values != unbiased.sort(-1).values).any(), "bias never matters"
    assert_close(y, ref_latent_moe(moe, x.double(), cfg))


# ---- 6. SiTU ------------------------------------------------------------------------------------------
def test_situ_and_mul():
    """§5: act(g, u) = 4 tanh(g/4) sigmoid(g) * 25 tanh(u/25), including the soft-capped tails."""
    torch.manual_seed(7)
    g = torch.cat([3 * torch.randn(200), torch.tensor([-300.0, -60.0, -9.0, 9.0, 60.0, 300.0])])
    u = torch.cat([10 * torch.randn(200), torch.tensor([-2000.0, 80.0, -40.0, 40.0, -80.0, 2000.0])])
    out = situ_and_mul(g, u)
    assert out.dtype == torch.float32
    ref = situ(g.double(), u.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    assert out.abs().max() <= 100.0 and out.abs().max() > 90.0  # caps: |4 tanh| <= 4, |25 tanh| <= 25


def test_dense_mlp_uses_situ(k3):
    """§5 dense FFN of layer 0: down(act(gate x, up x)) with the SiTU activation (not SiLU)."""
    cfg = k3.config
    assert (cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta) == ("situ", 4.0, 25.0)
    mlp = k3.model.layers[0].mlp
    torch.manual_seed(8)
    x = 4 * torch.randn(16, cfg.hidden_size)  # large enough that both tanh caps bend
    with torch.inference_mode():
        y = mlp(x)
    gate, up = lin(x.double(), mlp.gate_proj), lin(x.double(), mlp.up_proj)
    assert gate.abs().max() > 8 and up.abs().max() > 8
    assert_close(y, ref_dense_mlp(mlp, x.double()))


# ---- Kimi-Linear defaults -----------------------------------------------------------------------------
def test_kimi_linear_defaults(kimi_linear):
    """Kimi-Linear: softplus gate, low-rank g_a/g_b output gate, no K3 modules; the KDA layer follows §3."""
    cfg, layers = kimi_linear.config, kimi_linear.model.layers
    assert cfg.gate_lower_bound is None and not cfg.use_full_rank_gate
    assert cfg.attn_res_block_size is None and cfg.routed_expert_hidden_size is None and cfg.hidden_act == "silu"
    K, P, D = cfg.kda_head_dim, cfg.kda_num_heads * cfg.kda_head_dim, cfg.hidden_size
    kda, mla = layers[0].self_attn, layers[3].self_attn
    assert layers[0].is_kda and not layers[3].is_kda
    assert not hasattr(kda, "g_proj")
    assert kda.g_a_proj.weight.shape == (K, D) and kda.g_b_proj.weight.shape == (P, K)
    assert not hasattr(mla, "g_proj") and hasattr(mla, "q_proj")
    assert not hasattr(layers[1].block_sparse_moe, "routed_expert_down_proj")
    assert not hasattr(kimi_linear.model, "output_attn_res_norm")
    _, rec, _ = run_capturing(kimi_linear, {"attn": layers[1].self_attn}, num_tokens=20, seed=9)
    x, out = rec["attn"]
    assert_close(out, ref_kda_layer(layers[1].self_attn, x, cfg))
