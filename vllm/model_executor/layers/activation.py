"""Gated activations of the Kimi MLPs: SiLU-GLU (Kimi-Linear) and SiTU-GLU (Kimi-K3)."""
import torch


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """SiTU-GLU: beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta), computed in float32.

    The tanh soft-caps bound both branches, which keeps K3's wide MLPs stable in low precision.
    """
    g, u = gate.float(), up.float()
    out = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
    return out.to(gate.dtype)
