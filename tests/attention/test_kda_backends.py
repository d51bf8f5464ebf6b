"""Every KDA backend against the torch reference through the engine's interface (KDAAttention + builder).

GPU tests: decode groups of one-token rows (the graph path) and ragged 1..4-token rows at scattered slots,
prefill with and without initial states, mixed steps, fp32 and bf16 state, both gate forms, and hard inputs
(near-collinear keys, gates at the bound and near zero, 16K-token prompts, large states). A backend this
device cannot run is skipped with its own reason.
"""
from __future__ import annotations

import pytest
import torch

from kda_harness import Row, compare_to_reference, random_inputs, random_layer, random_pools
from vllm.attention.backend import LayerShapes
from vllm.attention.kda.metadata import KDAAttention
from vllm.attention.kda.triton_fla import TritonFLAKDABackend
from vllm.attention.kda.torch_ref import TorchKDABackend
from vllm.attention.selector import backend_reason, load_backend

W, K = 4, 128
DECODE = ["native", "triton", "flashinfer"]
PREFILL = ["triton", "flashkda", "flashinfer"]
# Bounds on relative error norms. In fp32 the recurrent kernels (native, fla's fused_recurrent_kda) keep fp32
# arithmetic: measured 1.7e-7 in the output and up to 9e-6 in the state (summation order over 128-wide dots,
# 2026-11-29_kda_backends_gpu_tests). fla's chunk_kda multiplies in TF32 even for fp32 inputs: up to 9e-4.
BOUND = {(torch.float32, torch.float32): 2e-5, (torch.float32, torch.bfloat16): 1e-2,
         (torch.bfloat16, torch.float32): 2e-2, (torch.bfloat16, torch.bfloat16): 3e-2}
TF32_CHUNK_BOUND = 2e-3


def _backend(flag: str, name: str, dtype: torch.dtype, H: int, bounded: bool, state_dtype: torch.dtype):
    shapes = LayerShapes(kda_num_heads=H, kda_head_dim=K, kda_gate_bounded=bounded, ssm_state_dtype=state_dtype)
    reason = backend_reason(flag, name, torch.device("cuda"), dtype, shapes)
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    return load_backend(flag, name)


DECODE_ROWS = [Row(1, 37, False, 5), Row(1, 3, False, 8), Row(1, 900, False, 11), Row(1, 12, False, 2)]
RAGGED_ROWS = [Row(2, 37, False, 5), Row(1, 3, False, 8), Row(4, 900, False, 11), Row(3, 12, False, 2)]
PREFILL_ROWS = [Row(70, 0, True, 3), Row(129, 64, True, 9), Row(1, 0, True, 6), Row(33, 200, True, 1)]
MIXED_ROWS = [Row(1, 40, False, 4), Row(50, 0, True, 8), Row(3, 17, False, 10), Row(64, 128, True, 7)]


def _case(H, act_dtype, state_dtype, lower_bound, seed, slots=12, T=None, gate_shift=0.0, state_scale=0.3):
    gen = torch.Generator().manual_seed(seed)
    layer = random_layer(H, K, W, lower_bound, "cuda", gen)
    pools = random_pools(layer, slots, W, act_dtype, state_dtype, "cuda", gen, state_scale)
    return layer, pools, gen


@pytest.mark.gpu
@pytest.mark.parametrize("name", DECODE)
@pytest.mark.parametrize("rows", [DECODE_ROWS, RAGGED_ROWS], ids=["one_token", "ragged"])
@pytest.mark.parametrize("act_dtype,state_dtype", list(BOUND))
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
def test_decode_backend_matches_reference(name, rows, act_dtype, state_dtype, lower_bound):
    H = 4
    decode = _backend("--kda-decode-backend", name, act_dtype, H, lower_bound is not None, state_dtype)
    layer, pools, gen = _case(H, act_dtype, state_dtype, lower_bound, seed=1)
    inputs = random_inputs(layer, sum(r.num_tokens for r in rows), act_dtype, "cuda", gen)
    compare_to_reference(KDAAttention(TorchKDABackend, decode), layer, inputs, pools, rows, "cuda",
                         BOUND[act_dtype, state_dtype])


# The triton backend's two prefill paths: fla's recurrent kernel for short chunks (these rows' lengths, by
# default) and chunk_kda, forced here at every length.
PREFILL_PATHS = [("triton", "chunked"), *[(n, "default") for n in PREFILL]]


@pytest.mark.gpu
@pytest.mark.parametrize("name,path", PREFILL_PATHS)
@pytest.mark.parametrize("rows", [PREFILL_ROWS, MIXED_ROWS], ids=["prefill", "mixed"])
@pytest.mark.parametrize("act_dtype,state_dtype", list(BOUND))
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
def test_prefill_backend_matches_reference(name, path, rows, act_dtype, state_dtype, lower_bound, monkeypatch):
    H = 4
    if path == "chunked":
        monkeypatch.setattr(TritonFLAKDABackend, "recurrent_prefill_max_len", 0)
    prefill = _backend("--kda-prefill-backend", name, act_dtype, H, lower_bound is not None, state_dtype)
    layer, pools, gen = _case(H, act_dtype, state_dtype, lower_bound, seed=2)
    inputs = random_inputs(layer, sum(r.num_tokens for r in rows), act_dtype, "cuda", gen)
    bound = BOUND[act_dtype, state_dtype]
    if path == "chunked":
        bound = max(bound, TF32_CHUNK_BOUND)
    compare_to_reference(KDAAttention(prefill, TorchKDABackend), layer, inputs, pools, rows, "cuda", bound)


@pytest.mark.gpu
@pytest.mark.parametrize("prefill_name,decode_name", [("triton", "native"), ("triton", "triton")])
def test_mixed_step_with_both_fast_backends(prefill_name, decode_name):
    H, act, state = 8, torch.bfloat16, torch.bfloat16
    prefill = _backend("--kda-prefill-backend", prefill_name, act, H, True, state)
    decode = _backend("--kda-decode-backend", decode_name, act, H, True, state)
    layer, pools, gen = _case(H, act, state, -5.0, seed=3)
    inputs = random_inputs(layer, sum(r.num_tokens for r in MIXED_ROWS), act, "cuda", gen)
    compare_to_reference(KDAAttention(prefill, decode), layer, inputs, pools, MIXED_ROWS, "cuda", BOUND[act, state])


def _collinear(inputs, layer, eps=1e-3):
    """Every token's key channels the same vector plus eps noise: the delta rule's hardest conditioning."""
    mixed = inputs[0].clone()
    P = layer.num_heads * layer.head_dim
    base = torch.randn(1, P, device=mixed.device, dtype=torch.float32)
    mixed[:, P:2 * P] = (base + eps * torch.randn_like(mixed[:, P:2 * P].float())).to(mixed.dtype)
    return (mixed, *inputs[1:])


HARD = {
    "collinear_keys": dict(transform=_collinear),
    "gate_at_lower_bound": dict(gate_shift=30.0),
    "gate_near_zero": dict(gate_shift=-30.0),
    "large_initial_state": dict(state_scale=100.0),
}


@pytest.mark.gpu
@pytest.mark.parametrize("flag,name", [("--kda-decode-backend", n) for n in DECODE]
                         + [("--kda-prefill-backend", n) for n in PREFILL])
@pytest.mark.parametrize("case", list(HARD))
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
def test_hard_inputs_stay_finite_and_accurate(flag, name, case, lower_bound):
    H, state = 4, torch.float32
    # fp32 activations where the backend takes them; bf16-only kernels (FlashKDA, FlashInfer) in bf16.
    act = torch.float32 if backend_reason(flag, name, torch.device("cuda"), torch.float32, LayerShapes(
        kda_num_heads=H, kda_head_dim=K, kda_gate_bounded=lower_bound is not None)) is None else torch.bfloat16
    backend = _backend(flag, name, act, H, lower_bound is not None, state)
    spec = HARD[case]
    layer, pools, gen = _case(H, act, state, lower_bound, seed=4, state_scale=spec.get("state_scale", 0.3))
    rows = RAGGED_ROWS if flag == "--kda-decode-backend" else PREFILL_ROWS
    inputs = random_inputs(layer, sum(r.num_tokens for r in rows), act, "cuda", gen, spec.get("gate_shift", 0.0))
    if "transform" in spec:
        inputs = spec["transform"](inputs, layer)
    attn = KDAAttention(TorchKDABackend, backend) if flag == "--kda-decode-backend" else KDAAttention(
        backend, TorchKDABackend)
    compare_to_reference(attn, layer, inputs, pools, rows, "cuda", 5e-3 if act == torch.float32 else 3e-2,
                         ref_dtype=torch.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("name", PREFILL)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_long_prompt_prefill(name, state_dtype):
    """A 16K-token prompt (plus a continued chunk) against a float64 reference."""
    H, act = 4, torch.bfloat16
    prefill = _backend("--kda-prefill-backend", name, act, H, True, state_dtype)
    layer, pools, gen = _case(H, act, state_dtype, -5.0, seed=5)
    rows = [Row(16384, 0, True, 3), Row(700, 1000, True, 8)]
    inputs = random_inputs(layer, sum(r.num_tokens for r in rows), act, "cuda", gen)
    compare_to_reference(KDAAttention(prefill, TorchKDABackend), layer, inputs, pools, rows, "cuda", 3e-2,
                         ref_dtype=torch.float64)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_native_decode_through_the_split_interface_on_cpu(state_dtype):
    """The KDA pair on the CPU: torch prefill + native decode (Triton interpreter) in a mixed step, at small
    shapes. Exercises the decode/prefill split, the token gathers and the output scatter of KDAAttention."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("covered at real shapes by the GPU tests above")
    from vllm.attention.kda.native import NativeKDABackend
    gen = torch.Generator().manual_seed(9)
    layer = random_layer(2, 32, W, -5.0, "cpu", gen)
    pools = random_pools(layer, 12, W, torch.float32, state_dtype, "cpu", gen)
    for rows in (MIXED_ROWS[:1] + [Row(1, 9, False, 11)], MIXED_ROWS):  # all-decode, then mixed
        inputs = random_inputs(layer, sum(r.num_tokens for r in rows), torch.float32, "cpu", gen)
        compare_to_reference(KDAAttention(TorchKDABackend, NativeKDABackend), layer, inputs, pools, rows, "cpu",
                             BOUND[torch.float32, state_dtype])


@pytest.mark.parametrize("max_query_len,num_tokens,chunked", [(1, 1, False), (256, 8192, False), (257, 257, True),
                                                               (16384, 16384, True), (64, 8256, True)])
def test_triton_prefill_takes_the_recurrent_kernel_for_short_chunks(max_query_len, num_tokens, chunked, monkeypatch):
    """The choice only (CPU): chunks up to recurrent_prefill_max_len tokens, in steps of up to
    recurrent_prefill_max_tokens, skip chunk_kda's host overhead."""
    assert (TritonFLAKDABackend.recurrent_prefill_max_len, TritonFLAKDABackend.recurrent_prefill_max_tokens) == \
        (256, 8192)
    taken = []
    monkeypatch.setattr(TritonFLAKDABackend, "_varlen", staticmethod(lambda *a, chunked=False: taken.append(chunked)))
    rows = type("Rows", (), {"max_query_len": max_query_len, "num_tokens": num_tokens})()
    TritonFLAKDABackend.forward_prefill(None, None, None, None, None, None, None, rows)
    assert taken == [chunked]
