"""The KDA (Kimi Delta Attention) mixer: projections here, the stateful core in an attention backend."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm.distributed.communication_op import tensor_model_parallel_all_reduce
from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.layernorm import RMSNormGated
from vllm.model_executor.layers.linear import merge_linear_weights
from vllm.transformers_utils.configs.kimi_k3 import KimiK3TextConfig


class ShortConvWeight(nn.Module):
    """Holds one depthwise causal-conv weight [P, W] under the checkpoint's `*_conv1d.weight` name."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, width))


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: KimiK3TextConfig, layer_idx: int, backend: Any) -> None:
        super().__init__()
        # Split by head over the tensor-parallel ranks: each holds H/N heads' projections, conv channels, gates
        # and states; the low-rank f_a/g_a are replicated; o_proj's partial sums are all-reduced.
        D, H, K = config.hidden_size, config.kda_num_heads // get_tensor_model_parallel_world_size(), \
            config.kda_head_dim
        P = H * K
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, H, K
        self.gate_lower_bound = config.gate_lower_bound
        self.backend = backend
        self.q_proj = nn.Linear(D, P, bias=False)
        self.k_proj = nn.Linear(D, P, bias=False)
        self.v_proj = nn.Linear(D, P, bias=False)
        self.q_conv1d = ShortConvWeight(P, config.conv_kernel_size)
        self.k_conv1d = ShortConvWeight(P, config.conv_kernel_size)
        self.v_conv1d = ShortConvWeight(P, config.conv_kernel_size)
        self.f_a_proj = nn.Linear(D, K, bias=False)
        self.f_b_proj = nn.Linear(K, P, bias=False)
        self.b_proj = nn.Linear(D, H, bias=False)
        if config.use_full_rank_gate:
            self.g_proj = nn.Linear(D, P, bias=False)
        else:
            self.g_a_proj = nn.Linear(D, K, bias=False)
            self.g_b_proj = nn.Linear(K, P, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(P))
        self.o_norm = RMSNormGated(K, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(P, D, bias=False)
        # Bound by the engine (or a test helper): [slots, 3P, W-1] and [slots, H, V, K].
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None
        self.records = None  # RecoverSSM's per-token records (attention/kda/recover.py), when it is on
        self.conv_weight: torch.Tensor | None = None
        self.qkv_weight: torch.Tensor | None = None  # [3P, D] and [K or 2K, D], set after loading
        self.gate_a_weight: torch.Tensor | None = None

    def process_weights_after_loading(self) -> None:
        # Backends read the q/k/v conv weights as one [3P, W] tensor, matching the packed q/k/v channels.
        self.conv_weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).detach()
        # Two GEMMs where there were a cat and five (q, k, v, f_a, g_a): mixed_qkv comes out contiguous, as every
        # backend reads it; the gates' low-rank inputs are column slices, which the b-side GEMMs read in place.
        self.qkv_weight = merge_linear_weights(self.q_proj, self.k_proj, self.v_proj)
        gates = (self.f_a_proj,) + (() if hasattr(self, "g_proj") else (self.g_a_proj,))
        self.gate_a_weight = merge_linear_weights(*gates)

    # The mixer in three parts, so that piecewise CUDA graphs (vllm/worker/piecewise.py) can capture the
    # projections and run only the stateful core eagerly: forward = output(attend(project(x)), x).
    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(mixed_qkv, raw_gate, raw_beta, output_gate), the core's inputs."""
        assert self.qkv_weight is not None, "KimiDeltaAttention.process_weights_after_loading() was not run"
        mixed_qkv = nn.functional.linear(x, self.qkv_weight)
        gate_a = nn.functional.linear(x, self.gate_a_weight)
        K = self.head_dim
        output_gate = self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(gate_a[..., K:])
        return mixed_qkv, self.f_b_proj(gate_a[..., :K]), self.b_proj(x), output_gate

    def attend(self, inputs: tuple[torch.Tensor, ...], attn_metadata: Any) -> torch.Tensor:
        assert self.conv_state is not None and self.ssm_state is not None, "KDA state pools are not bound"
        return self.backend.forward(self, *inputs, self.conv_state, self.ssm_state, attn_metadata, self.records)

    def output(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return tensor_model_parallel_all_reduce(self.o_proj(y))

    def forward(self, x: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        return self.output(self.attend(self.project(x), attn_metadata), x)
