"""Triton gated RMSNorm for the KDA backends whose library stops at the core output (fla-core, FlashKDA).

One launch instead of torch's five elementwise/reduction kernels: per (token, head) row of the core output,
y = rmsnorm(x) * weight * sigmoid(gate), with x first rounded to the activation dtype (as the kernels that
fuse the norm store it) and the math in fp32. Same result as `RMSNormGated` up to fp32 rounding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.attention.kda.metadata import KDAWeights


@triton.jit(do_not_specialize=["n_rows"])  # the step's token count: one kernel for all
def _gated_rmsnorm_kernel(x_ptr, gate_ptr, w_ptr, y_ptr, n_rows, H, stride_gate, eps, V,
                          BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # row = token * H + head
    v = tl.arange(0, BLOCK_V)
    ok = (r < n_rows)[:, None] & (v < V)[None, :]
    offs = r[:, None].to(tl.int64) * V + v[None, :]
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(y_ptr.dtype.element_ty).to(tl.float32)
    g_offs = (r // H).to(tl.int64)[:, None] * stride_gate + ((r % H) * V)[:, None] + v[None, :]
    g = tl.load(gate_ptr + g_offs, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + v, mask=v < V, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / V + eps)
    y = x * inv[:, None] * w[None, :] * tl.sigmoid(g)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=ok)


def fused_gated_norm(layer: KDAWeights, core: torch.Tensor, output_gate: torch.Tensor,
                     act_dtype: torch.dtype) -> torch.Tensor:
    """`metadata.gated_norm` in one launch: core [T, H, V], output_gate [T, P] (rows may be strided) -> [T, P]."""
    T, H, V = core.shape
    core = core.contiguous()
    assert output_gate.stride(-1) == 1
    y = torch.empty(T, H * V, dtype=act_dtype, device=core.device)
    if T == 0:
        return y
    block_v = triton.next_power_of_2(V)
    block_r = max(1, 4096 // block_v)
    _gated_rmsnorm_kernel[(triton.cdiv(T * H, block_r),)](
        core, output_gate, layer.o_norm.weight, y, T * H, H, output_gate.stride(0), layer.o_norm.eps, V,
        BLOCK_R=block_r, BLOCK_V=block_v)
    return y
