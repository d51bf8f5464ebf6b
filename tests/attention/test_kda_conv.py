"""The Triton ragged causal conv + SiLU equals the torch reference conv, and updates the state pool like it."""
from __future__ import annotations

import os

import pytest
import torch

from vllm.attention.kda.ops import causal_conv1d

# Triton runs CPU tensors only in its interpreter (the CPU suite); on a GPU machine the cuda row covers the kernel.
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                        reason="CPU tensors run through the Triton interpreter")),
           pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits,tile", [(1, {}), (3, {}), (3, dict(block_t=4, block_c=16, num_warps=2))],
                         ids=["one_split", "qkv_splits", "small_tiles"])
@pytest.mark.parametrize("history_major", [False, True], ids=["channels_major", "history_major"])
@pytest.mark.parametrize("rows", ["ragged", "decode"])
def test_ragged_conv_matches_reference(device, dtype, num_splits, tile, history_major, rows):
    pytest.importorskip("triton")
    from vllm.attention.kda.conv import causal_conv1d_silu
    gen = torch.Generator().manual_seed(0)
    C, W, slots = 48, 4, 9
    if rows == "ragged":
        # A fresh prompt, a continued chunk, decode rows of 1 and 2 tokens (shorter than W-1: history shifts),
        # a zero-length padding row and a row whose slot is -1.
        lens = [7, 5, 1, 2, 0, 3]
        slot_ids = [4, 0, 7, 2, 5, -1]
        has_init = [False, True, True, True, True, True]
    else:  # one token per row: the one-row tile
        lens, slot_ids, has_init = [1, 1, 1], [3, 8, 1], [True, True, False]
    T = sum(lens)
    x = torch.randn(T, C, generator=gen).to(dtype)
    weight = torch.randn(C, W, generator=gen)
    state = torch.randn(slots, C, W - 1, generator=gen).to(dtype)
    if history_major:  # FlashInfer's pool layout: strides [slot, 1, C]
        state = state.transpose(1, 2).contiguous().transpose(1, 2)
    qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    x, weight, state, qsl = (t.to(device) for t in (x, weight, state, qsl))
    ref_state = state.clone()
    y = causal_conv1d_silu(x, weight, state, qsl, torch.tensor(slot_ids, dtype=torch.int32, device=device),
                           torch.tensor(has_init, device=device), max_query_len=max(lens), num_splits=num_splits,
                           **tile)
    assert y.shape == (num_splits, T, C // num_splits)
    y = y.permute(1, 0, 2).reshape(T, C)  # back to [T, C]: split s holds channels s*C/n .. (s+1)*C/n
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for r, (n, slot, init) in enumerate(zip(lens, slot_ids, has_init)):
        s = int(qsl[r])
        if n == 0 or slot < 0:
            continue
        out, new_state = causal_conv1d(x[s:s + n], weight, ref_state[slot] if init else None)
        torch.testing.assert_close(y[s:s + n].float(), torch.nn.functional.silu(out), **tol)
        ref_state[slot] = new_state.to(dtype)
    torch.testing.assert_close(state, ref_state, rtol=0, atol=0)  # untouched slots stay exactly as they were
