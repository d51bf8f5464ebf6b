"""The KDA (Kimi Delta Attention) mixer: projections here, the stateful core in an attention backend."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm.distributed.communication_op import tensor_model_parallel_all_reduce
from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.layernorm import RMSNormGated
from vllm.model_executor.layers.linear import merge_linear_weights, stack_linear_weights
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
        self.in_proj_weight: torch.Tensor | None = None  # every projection of x but o_proj's, set after loading
        self.in_proj_split: list[int] = []
        self.gate_b_weight: torch.Tensor | None = None  # f_b and g_b stacked [2, P, K] (low-rank output gate)

    def process_weights_after_loading(self) -> None:
        # Backends read the q/k/v conv weights as one [3P, W] tensor, matching the packed q/k/v channels.
        self.conv_weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).detach()
        # One GEMM where there were three (q/k/v, f_a + g_a, b): each result is a column slice of its output, which
        # the backends (rows by stride) and the gates' second halves read in place.
        gate = self.g_proj if hasattr(self, "g_proj") else self.g_a_proj
        parts = (self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, gate, self.b_proj)
        self.in_proj_weight = merge_linear_weights(*parts, pad_to=8)
        widths = [3 * self.q_proj.out_features, self.head_dim, gate.out_features, self.num_heads]
        self.in_proj_split = widths + [self.in_proj_weight.shape[0] - sum(widths)]  # the last: alignment padding
        # The low-rank gates' second halves as one batched GEMM: f_a and g_a sit side by side in that output.
        self.gate_b_weight = None if hasattr(self, "g_proj") else stack_linear_weights(self.f_b_proj, self.g_b_proj)

    # The mixer in three parts, so that piecewise CUDA graphs (vllm/worker/piecewise.py) can capture the
    # projections and run only the stateful core eagerly: forward = output(attend(project(x)), x).
    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(mixed_qkv, raw_gate, raw_beta, output_gate), the core's inputs (column slices of one GEMM's output,
        rows strided, but for raw_gate)."""
        assert self.in_proj_weight is not None, "KimiDeltaAttention.process_weights_after_loading() was not run"
        projected = nn.functional.linear(x, self.in_proj_weight)
        mixed_qkv, f_a, gate, raw_beta, _ = projected.split(self.in_proj_split, -1)
        if self.gate_b_weight is None:  # a full-rank output gate
            return mixed_qkv, self.f_b_proj(f_a), raw_beta, gate
        K, start = self.head_dim, self.in_proj_split[0]
        low_rank = projected[:, start:start + 2 * K].unflatten(-1, (2, K)).transpose(0, 1)  # f_a, g_a: [2, T, K]
        raw_gate, output_gate = torch.bmm(low_rank, self.gate_b_weight.transpose(1, 2))  # [2, T, P]
        return mixed_qkv, raw_gate, raw_beta, output_gate

    def attend(self, inputs: tuple[torch.Tensor, ...], attn_metadata: Any) -> torch.Tensor:
        assert self.conv_state is not None and self.ssm_state is not None, "KDA state pools are not bound"
        return self.backend.forward(self, *inputs, self.conv_state, self.ssm_state, attn_metadata, self.records)

    def output(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return tensor_model_parallel_all_reduce(self.o_proj(y))

    def forward(self, x: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        return self.output(self.attend(self.project(x), attn_metadata), x)
