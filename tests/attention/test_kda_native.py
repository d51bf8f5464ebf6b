"""fused_kda_decode (Triton) against the torch KDA reference: on CPU through the Triton interpreter, on CUDA for real.

The reference composes vllm.attention.kda.ops and rms_normalize one request at a time, the way the torch backend
does; every test also checks that slots and output rows the kernel must not touch keep their exact bits. K = 64
on the CPU gives the kernel two V-blocks of state rows (BLOCK_V = 32) to carry a row's tokens across.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from vllm.attention.kda.native import arrival_counters, fused_kda_decode
from vllm.attention.kda.ops import causal_conv1d, kda_gate, kda_recurrent, l2norm
from vllm.model_executor.layers.layernorm import rms_normalize

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
W = 4
NORM_EPS = 1e-5
SENTINEL = 123.0  # output value of rows the kernel must skip
# Output / state tolerances by dtype: a bf16 ulp allows for the interpreter's fp32 -> bf16 casts, which truncate
# (GPUs round to nearest even); fp16 casts round correctly everywhere.
TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-4}, torch.float16: {"rtol": 2e-3, "atol": 2e-3},
       torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}


def shapes(device: str, cpu=(2, 64), cuda=(4, 128)) -> tuple[int, int]:
    """(H, K): small for the interpreter, the real head size on CUDA."""
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors run through the Triton interpreter only")
    return cpu if device == "cpu" else cuda


def make_case(lens, num_slots, H, K, act_dtype, state_dtype, device, seed, lower_bound=-5.0):
    gen = torch.Generator().manual_seed(seed)
    T, P = sum(lens), H * K

    def randn(*shape, scale=1.0, dtype=torch.float32):
        return (scale * torch.randn(*shape, generator=gen)).to(device=device, dtype=dtype)

    return {
        "mixed_qkv": randn(T, 3 * P, dtype=act_dtype),
        "raw_gate": randn(T, P, scale=2.0, dtype=act_dtype),
        "raw_beta": randn(T, H, dtype=act_dtype),
        "output_gate": randn(T, P, dtype=act_dtype),
        "conv_weight": randn(3 * P, W, scale=0.5, dtype=act_dtype),
        "A_log": (2 * torch.rand(H, generator=gen) - 1).to(device),
        "dt_bias": randn(P, scale=0.5),
        "norm_weight": (1 + randn(K, scale=0.1)).to(act_dtype),
        "norm_eps": NORM_EPS,
        "lower_bound": lower_bound,
        "conv_state": randn(num_slots, 3 * P, W - 1, dtype=act_dtype),
        "ssm_state": randn(num_slots, H, K, K, dtype=state_dtype),
        "query_start_loc": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                                        device=device),
    }


def reference(case, state_indices, num_accepted_tokens, H, K, exact=False):
    """Expected (out, conv_state, ssm_state, written slots); the inputs' pools are not modified.

    exact: accumulate in float64 instead of float32 (activations and o are still rounded where the kernel rounds).
    """
    act, acc = case["mixed_qkv"].dtype, torch.float64 if exact else torch.float32
    c = {name: x.to(acc) if torch.is_tensor(x) and x.is_floating_point() else x for name, x in case.items()}
    conv_state, ssm_state = case["conv_state"].clone(), case["ssm_state"].clone()
    out = torch.full_like(case["output_gate"], SENTINEL)
    qsl, written = case["query_start_loc"].tolist(), set()
    for r, cols in enumerate(state_indices.tolist()):
        s, e = qsl[r], qsl[r + 1]
        spec = isinstance(cols, list)
        src = cols[num_accepted_tokens[r] - 1] if spec else cols
        if e == s or src < 0:
            continue
        x, conv0 = c["mixed_qkv"][s:e], c["conv_state"][src]
        conv_out, conv_final = causal_conv1d(x, c["conv_weight"], conv0)
        qkv = torch.nn.functional.silu(conv_out).to(act).to(acc)
        q, k, v = (y.unflatten(-1, (H, K)) for y in qkv.chunk(3, dim=-1))
        g = kda_gate(c["raw_gate"][s:e], c["A_log"], c["dt_bias"], K, case["lower_bound"])
        ckpt = torch.empty(e - s, H, K, K, device=x.device, dtype=acc)
        o, final = kda_recurrent(l2norm(q) * K ** -0.5, l2norm(k), v, g, torch.sigmoid(c["raw_beta"][s:e]),
                                 c["ssm_state"][src], checkpoints=ckpt)
        gate = torch.sigmoid(case["output_gate"][s:e].float().unflatten(-1, (H, K)))
        y = rms_normalize(o.to(act), case["norm_eps"]) * case["norm_weight"].float() * gate
        out[s:e] = y.to(act).flatten(-2)
        if spec:
            for t in range(e - s):
                if cols[t] >= 0:
                    ssm_state[cols[t]] = ckpt[t].to(ssm_state.dtype)
                    conv_state[cols[t]] = causal_conv1d(x[:t + 1], c["conv_weight"], conv0)[1].to(act)
                    written.add(cols[t])
        else:
            ssm_state[src], conv_state[src] = final.to(ssm_state.dtype), conv_final.to(act)
            written.add(src)
    return out, conv_state, ssm_state, written


def run_kernel(case, state_indices, H, K, num_accepted_tokens=None, **knobs):
    """The kernel on copies of the pools, into an output pre-filled with SENTINEL."""
    conv_state, ssm_state = case["conv_state"].clone(), case["ssm_state"].clone()
    out = torch.full_like(case["output_gate"], SENTINEL)
    res = fused_kda_decode(**{**case, "conv_state": conv_state, "ssm_state": ssm_state},
                           state_indices=state_indices, num_accepted_tokens=num_accepted_tokens, num_heads=H,
                           head_dim=K, max_query_len=max(case["query_start_loc"].diff().tolist()), out=out, **knobs)
    assert res is out
    return out, conv_state, ssm_state


def run_and_check(case, state_indices, H, K, num_accepted_tokens=None, **knobs):
    """Checks outputs, written slots and untouched slots against the reference; returns the kernel's results."""
    exp_out, exp_conv, exp_ssm, written = reference(
        case, state_indices, None if num_accepted_tokens is None else num_accepted_tokens.tolist(), H, K)
    out, conv_state, ssm_state = run_kernel(case, state_indices, H, K, num_accepted_tokens, **knobs)
    act = case["mixed_qkv"].dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, exp_out, **TOL[act])  # also holds skipped rows to SENTINEL
    torch.testing.assert_close(conv_state, exp_conv, rtol=0, atol=0)  # conv states are copied inputs
    torch.testing.assert_close(ssm_state, exp_ssm, **TOL[torch.bfloat16 if ssm_state.dtype == torch.bfloat16 else act])
    if act == torch.float16:
        # Ulp-level tolerances cannot see a skipped rounding step (SiLU output, o before the norm), but it moves
        # about a fifth of the fp16 outputs off the reference's, where a faithful kernel moves almost none.
        assert (out != exp_out).float().mean() < 0.05
    untouched = [i for i in range(ssm_state.shape[0]) if i not in written]
    assert torch.equal(ssm_state[untouched], case["ssm_state"][untouched])
    return out, ssm_state, written


def indices(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_ragged_rows_match_reference(device, act_dtype, state_dtype, lower_bound):
    """Rows of 1..4 tokens at scattered slots, a zero-length row and a -1 slot row that must be skipped."""
    H, K = shapes(device, cuda=(12, 128))
    lens = [1, 3, 0, 2, 4, 1]
    slots = indices([5, 1, 7, -1, 10, 3], device)
    case = make_case(lens, 12, H, K, act_dtype, state_dtype, device, seed=1, lower_bound=lower_bound)
    _, _, written = run_and_check(case, slots, H, K)
    assert written == {5, 1, 10, 3}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_columns(device, state_dtype):
    """2-D indices: the state after token t goes to column t, starting from column num_accepted - 1."""
    H, K = shapes(device, cpu=(3, 64))
    lens = [3, 2, 3, 0, 3]
    cols = indices([[0, 4, 8], [1, 5, 9], [2, 6, 11], [3, 7, 12], [-1, -1, -1]], device)
    accepted = indices([1, 3, 2, 1, 1], device)
    case = make_case(lens, 14, H, K, torch.float32, state_dtype, device, seed=2)
    _, ssm_state, written = run_and_check(case, cols, H, K, num_accepted_tokens=accepted)
    # Row 1 has 2 tokens and reads column 2 (slot 9), which it must not write.
    assert written == {0, 4, 8, 1, 5, 2, 6, 11}
    assert torch.equal(ssm_state[9], case["ssm_state"][9])
    # Row 2 starts from column 1 (slot 6) and overwrites it in place with the state after its token 1.
    assert not torch.equal(ssm_state[6], case["ssm_state"][6])


@pytest.mark.parametrize("device", DEVICES)
def test_one_token_rows_and_plain_decode_chain(device):
    """Two plain decode steps equal one two-token row: the conv and ssm states carry exactly."""
    H, K = shapes(device)
    case = make_case([2], 2, H, K, torch.float32, torch.float32, device, seed=3)
    whole, whole_ssm, _ = run_and_check(case, indices([1], device), H, K)
    conv_state, ssm_state = case["conv_state"].clone(), case["ssm_state"].clone()
    steps = []
    for t in range(2):
        one = {**case, "conv_state": conv_state, "ssm_state": ssm_state,
               "query_start_loc": indices([0, 1], device)}
        for name in ("mixed_qkv", "raw_gate", "raw_beta", "output_gate"):
            one[name] = case[name][t:t + 1]
        steps.append(fused_kda_decode(**one, state_indices=indices([1], device), num_heads=H, head_dim=K,
                                      max_query_len=1))
    torch.testing.assert_close(torch.cat(steps), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ssm_state, whole_ssm, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_hard_inputs(device, lower_bound):
    """Near-collinear keys with queries along them, gates at the lower bound and near zero, large states.

    With q along the keys just written, o = S q cancels terms of size |S| down to |v|, so any fp32 rounding is
    amplified by |S| / |o|: the kernel is held to a float64 reference, no further off than fp32 torch is.
    """
    H, K = shapes(device)
    P, lens, slots = H * K, [4, 4], indices([2, 0], device)
    case = make_case(lens, 3, H, K, torch.float32, torch.float32, device, seed=4, lower_bound=lower_bound)
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(P, generator=gen).to(device)
    keys = base + 1e-3 * torch.randn(sum(lens), P, generator=gen).to(device)
    case["mixed_qkv"][:, :P], case["mixed_qkv"][:, P:2 * P] = keys, keys
    case["conv_state"][:, :2 * P] = base.repeat(2)[:, None]
    case["conv_weight"][:P] = case["conv_weight"][P:2 * P]
    # Half the channels saturate their gate (lower bound / softplus's linear range), half nearly never decay.
    saturated = torch.arange(P, device=device) % 2 == 0
    case["raw_gate"] = torch.where(saturated, 40.0, -40.0).expand(sum(lens), P).clone()
    case["raw_beta"].fill_(8.0)
    case["ssm_state"] *= 1e3

    out, _, ssm_state = run_kernel(case, slots, H, K)
    ref32, _, ref_ssm, _ = reference(case, slots, None, H, K)
    exact = reference(case, slots, None, H, K, exact=True)[0]
    assert torch.isfinite(out).all() and torch.isfinite(ssm_state).all()
    err, ref_err = (out.double() - exact).abs().max(), (ref32.double() - exact).abs().max()
    assert err <= 3 * ref_err + 1e-5, (err, ref_err)
    torch.testing.assert_close(ssm_state, ref_ssm, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split,block_v,prefetch,num_warps", [(1, 16, False, 2), (1, 64, True, None),
                                                             (2, 16, True, 4), (4, 16, False, None)])
def test_tuning_knobs_give_the_same_results(device, split, block_v, prefetch, num_warps):
    """Programs per head, rows per block, prefetching and warps change only the schedule: outputs and pools
    equal the default's."""
    H, K = shapes(device)
    lens = [1, 2, 1, 3]
    slots = indices([4, 9, 2, 6], device)
    case = make_case(lens, 10, H, K, torch.float32, torch.float32, device, seed=7)
    want = run_kernel(case, slots, H, K)
    conv_state, ssm_state = case["conv_state"].clone(), case["ssm_state"].clone()
    out = torch.full_like(case["output_gate"], SENTINEL)
    fused_kda_decode(**{**case, "conv_state": conv_state, "ssm_state": ssm_state}, state_indices=slots,
                     num_heads=H, head_dim=K, max_query_len=3, out=out, split=split, block_v=block_v,
                     prefetch=prefetch, num_warps=num_warps)
    for got, ref in zip((out, conv_state, ssm_state), want):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_arrival_counters_are_zero_after_every_launch(device):
    """The last part of each (request, head) to arrive resets its counter, so a graph replay starts from zeros;
    rows that are skipped never count."""
    H, K = shapes(device)
    case = make_case([2, 0, 1], 8, H, K, torch.float32, torch.float32, device, seed=8)
    for split in (2, 2, 1, 2):
        run_and_check(case, indices([3, 5, -1], device), H, K, split=split)
        assert not arrival_counters(torch.device(device), 3 * H).any()
