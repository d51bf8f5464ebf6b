"""Builds random KDA layers, state pools and steps, and runs a backend pair against the torch reference."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from vllm.attention.backend import CommonAttentionMetadata
from vllm.attention.kda.metadata import KDAAttention
from vllm.attention.kda.torch_ref import TorchKDABackend
from vllm.model_executor.layers.layernorm import RMSNormGated


@dataclass
class Row:
    num_tokens: int
    num_computed: int  # tokens cached before this step (0 = fresh prompt)
    prefilling: bool
    slot: int


def random_layer(H: int, K: int, W: int, lower_bound: float | None, device, gen: torch.Generator):
    P = H * K
    norm = RMSNormGated(K, eps=1e-5)
    norm.weight.data = 1 + 0.1 * torch.randn(K, generator=gen)
    return SimpleNamespace(
        num_heads=H, head_dim=K, gate_lower_bound=lower_bound,
        conv_weight=(torch.randn(3 * P, W, generator=gen) * 0.5).to(device),
        A_log=(torch.randn(H, generator=gen) * 0.5).to(device),
        dt_bias=(torch.randn(P, generator=gen) * 0.5).to(device), o_norm=norm.to(device))


def random_pools(layer, slots: int, W: int, act_dtype, state_dtype, device, gen, state_scale: float = 0.3):
    H, K = layer.num_heads, layer.head_dim
    conv = torch.randn(slots, 3 * H * K, W - 1, generator=gen).to(device, act_dtype)
    ssm = (torch.randn(slots, H, K, K, generator=gen) * state_scale).to(device, state_dtype)
    return conv, ssm


def random_inputs(layer, T: int, act_dtype, device, gen, gate_shift: float = 0.0):
    """(mixed_qkv, raw_gate, raw_beta, output_gate) as the model hands them over: mixed_qkv, raw_beta and
    output_gate are column slices of one projection's output (rows strided), raw_gate is contiguous."""
    H, K = layer.num_heads, layer.head_dim
    P = H * K
    mixed = torch.randn(T, 3 * P, generator=gen)
    raw_gate = torch.randn(T, P, generator=gen) + gate_shift
    raw_beta = torch.randn(T, H, generator=gen)
    out_gate = torch.randn(T, P, generator=gen)
    pad = torch.randn(T, 8, generator=gen)  # like the merged projection's alignment padding, never read
    projected = torch.cat([mixed, out_gate, raw_beta, pad], -1).to(device, act_dtype)
    mixed, out_gate, raw_beta, _ = projected.split([3 * P, P, H, 8], -1)
    return mixed, raw_gate.to(device, act_dtype), raw_beta, out_gate


def common_metadata(rows: list[Row], device) -> CommonAttentionMetadata:
    lens = torch.tensor([r.num_tokens for r in rows], dtype=torch.int32)
    qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
    qsl[1:] = lens.cumsum(0)
    seq_lens = torch.tensor([r.num_computed + r.num_tokens for r in rows], dtype=torch.int32)
    slots = torch.tensor([r.slot for r in rows], dtype=torch.int32)
    T = int(qsl[-1])
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq_lens.to(device),
        seq_lens_cpu=seq_lens, num_reqs=len(rows), num_actual_tokens=T, max_query_len=int(lens.max()),
        max_seq_len=int(seq_lens.max()), block_table=torch.zeros(len(rows), 1, dtype=torch.int32, device=device),
        slot_mapping=torch.full((T,), -1, dtype=torch.int64, device=device),
        is_prefilling=torch.tensor([r.prefilling for r in rows]), state_indices=slots.to(device),
        state_indices_cpu=slots)


def run_pair(attn: KDAAttention, layer, inputs, pools, rows: list[Row], device):
    """One step through `attn`; returns (output, conv_pool, ssm_pool) after the step (pools copied first, the
    conv pool into the layout the pair's decode backend asks for)."""
    conv, ssm = (p.clone() for p in pools)
    if attn.conv_state_history_major:
        conv = conv.transpose(1, 2).contiguous().transpose(1, 2)
    meta = attn.builder(16).build(common_metadata(rows, device))
    with torch.inference_mode():
        out = attn.forward(layer, *inputs, conv, ssm, meta)
    return out, conv, ssm


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, in float64."""
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def compare_to_reference(attn: KDAAttention, layer, inputs, pools, rows, device, bound: float,
                         ref_dtype: torch.dtype | None = None) -> dict[str, float]:
    """Runs `attn` and the torch reference on the same step; asserts output and both pools agree.

    Errors are relative norms (printed, so GPU logs record them). ref_dtype=torch.float64 runs the reference
    on float64 copies, for inputs where a float32 reference is not accurate enough.
    """
    ref_layer, ref_inputs, ref_pools = layer, inputs, pools
    if ref_dtype is not None:
        ref_layer = copy.copy(layer)
        ref_layer.conv_weight = layer.conv_weight.to(ref_dtype)
        ref_layer.A_log, ref_layer.dt_bias = layer.A_log.to(ref_dtype), layer.dt_bias.to(ref_dtype)
        ref_layer.o_norm = copy.deepcopy(layer.o_norm).to(ref_dtype)
        ref_inputs = tuple(x.to(ref_dtype) for x in inputs)
        ref_pools = tuple(p.to(ref_dtype) for p in pools)
    ref = KDAAttention(TorchKDABackend, TorchKDABackend)
    want = run_pair(ref, ref_layer, ref_inputs, ref_pools, rows, device)
    got = run_pair(attn, layer, inputs, pools, rows, device)
    assert torch.isfinite(got[0].float()).all() and torch.isfinite(got[2].float()).all()
    errs = {name: rel_err(g, w) for name, g, w in zip(("out", "conv", "ssm"), got, want)}
    print(f"{attn.name}: relative errors {errs}")
    assert max(errs.values()) <= bound, errs
    return errs
