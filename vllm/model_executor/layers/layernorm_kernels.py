"""RMSNorm (optionally after a residual add) as one Triton launch per call.

In torch the norm is eight kernels (cast, square, mean, add eps, rsqrt, scale, cast back, weight) and the
residual add a ninth; a decode step of the 1.3B config ran ~150 of them, each a few microseconds of launch
latency in a graph and tens of microseconds of host time eagerly. The kernel rounds exactly where the torch
form does (the sum to the residual dtype, the normalised row to the input dtype, the weight product to the
output dtype), so only the order of the fp32 sum of squares differs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, res_out_ptr, w_ptr, out_ptr, stride_x, stride_res, stride_res_out,
                     stride_out, N, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    y = (xf * inv_rms).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * (x / rms(x)) over the last dim; with `residual`, (that of s, s) for s = x + residual. Rows may be
    strided (a split view); the last dim must be contiguous."""
    shape, N = x.shape, x.shape[-1]
    x2 = x.reshape(-1, N)
    res2 = res_out = res_out2 = None
    normed_dtype = x.dtype
    if residual is not None:
        res2 = residual.reshape(-1, N)
        normed_dtype = torch.promote_types(x.dtype, residual.dtype)
        res_out = torch.empty(shape, dtype=normed_dtype, device=x.device)
        res_out2 = res_out.view(-1, N)
    out = torch.empty(shape, dtype=torch.promote_types(weight.dtype, normed_dtype), device=x.device)
    out2 = out.view(-1, N)
    for t in (x2, res2, weight):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"rms_norm needs a contiguous last dim, got strides {tuple(t.stride())}")
    rows = x2.shape[0]
    if rows:
        BLOCK = triton.next_power_of_2(N)
        _rms_norm_kernel[(rows,)](
            x2, res2 if res2 is not None else x2, res_out2 if res_out2 is not None else out2, weight, out2,
            x2.stride(0), res2.stride(0) if res2 is not None else 0,
            res_out2.stride(0) if res_out2 is not None else 0, out2.stride(0), N, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=BLOCK, num_warps=min(16, max(1, BLOCK // 512)))
    return out if residual is None else (out, res_out)
