"""RMSNorm variants used by Kimi models. Statistics are always taken in float32."""
import torch
from torch import nn

try:
    from vllm.model_executor.layers import layernorm_kernels
except ImportError:  # no triton (a CPU install): the torch form below
    layernorm_kernels = None


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual` (upstream's fused form), (norm(s), s) for s = x + residual."""
        if x.is_cuda and layernorm_kernels is not None:
            return layernorm_kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self.forward_native(x)
        s = x + residual
        return self.forward_native(s), s

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        # Cast back before the weight multiply, as the reference implementations do.
        return self.weight * rms_normalize(x, self.eps).to(x.dtype)


class RMSNormGated(nn.Module):
    """Per-head RMSNorm followed by a sigmoid output gate: KDA's `o_norm` (FusedRMSNormGated)."""

    def __init__(self, head_dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = rms_normalize(x, self.eps) * self.weight.float() * torch.sigmoid(gate.float())
        return y.to(x.dtype)
