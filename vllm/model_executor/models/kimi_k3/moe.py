"""Dense MLP and the MoE block: sigmoid router with grouped top-k, shared experts, optional latent MoE."""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from vllm.distributed.communication_op import tensor_model_parallel_all_reduce
from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size, get_tp_group
from vllm.model_executor.layers.activation import silu_and_mul, situ_and_mul
from vllm.model_executor.layers.fused_moe import MoEActivation, fused_experts, fused_moe_unsupported, grouped_topk
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import merge_linear_weights
from vllm.transformers_utils.configs.kimi_k3 import KimiK3TextConfig


def gated_activation(config: KimiK3TextConfig):
    if config.hidden_act == "situ":
        return partial(situ_and_mul, beta=config.activation_situ_beta,
                       linear_beta=config.activation_situ_linear_beta)
    return silu_and_mul


def capturing_graph(x: torch.Tensor) -> bool:
    """Whether x's stream is being captured into a CUDA graph, where group sizes cannot reach the host."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


class KimiMLP(nn.Module):
    """Gate/up split by intermediate column over the tensor-parallel ranks, down_proj by row: each rank's output
    is a partial sum, all-reduced here unless `reduce_results` is off (the MoE adds it to its experts' first)."""

    def __init__(self, config: KimiK3TextConfig, in_size: int, intermediate_size: int,
                 reduce_results: bool = True) -> None:
        super().__init__()
        intermediate_size //= get_tensor_model_parallel_world_size()
        self.reduce_results = reduce_results
        self.gate_proj = nn.Linear(in_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(in_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, in_size, bias=False)
        self.act = gated_activation(config)
        self.gate_up_weight: torch.Tensor | None = None

    def process_weights_after_loading(self) -> None:
        """One [2I, in] gate/up weight, one GEMM per call; gate_proj/up_proj become views into it."""
        self.gate_up_weight = merge_linear_weights(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            raise RuntimeError("KimiMLP.process_weights_after_loading() must merge gate_proj and up_proj first")
        gate, up = nn.functional.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        out = self.down_proj(self.act(gate, up))
        return tensor_model_parallel_all_reduce(out) if self.reduce_results else out


class KimiExpert(nn.Module):
    """One routed expert under the checkpoint names w1 (gate), w3 (up), w2 (down)."""

    def __init__(self, config: KimiK3TextConfig, in_size: int) -> None:
        super().__init__()
        tp = get_tp_group()
        # Split as KimiMLP's, or whole under expert parallelism (each rank then holds some of the experts).
        inter = config.moe_intermediate_size // (1 if tp.expert_parallel else tp.world_size)
        self.w1 = nn.Linear(in_size, inter, bias=False)
        self.w3 = nn.Linear(in_size, inter, bias=False)
        self.w2 = nn.Linear(inter, in_size, bias=False)
        self.act = gated_activation(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x), self.w3(x)))


class KimiRouter(nn.Module):
    """Sigmoid scores; experts chosen by score + e_score_correction_bias within the best groups."""

    def __init__(self, config: KimiK3TextConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.empty(config.num_experts))
        self.top_k, self.num_groups, self.topk_group = (config.num_experts_per_token, config.num_expert_group,
                                                        config.topk_group)
        self.renormalize, self.scale = config.moe_renormalize, config.routed_scaling_factor

    def forward(self, x: torch.Tensor, with_shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (weights [T, k] float32, expert ids [T, k]); `with_shared`: a last column choosing expert E
        (the shared expert stacked after the routed ones) with weight 1."""
        logits = x.float() @ self.weight.float().t()
        if logits.is_cuda and fused_moe_unsupported(logits) is None:
            return grouped_topk(logits, self.e_score_correction_bias.float(), self.top_k, self.num_groups,
                                self.topk_group, self.renormalize, self.scale, with_shared=with_shared)
        weights, ids = self.forward_native(logits)
        if with_shared:
            T, E = logits.shape
            weights = torch.cat([weights, weights.new_ones(T, 1)], 1)
            ids = torch.cat([ids, ids.new_full((T, 1), E)], 1)
        return weights, ids

    def forward_native(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch form of the choice from the router logits [T, E] float32 (the CPU path and the reference)."""
        scores = torch.sigmoid(logits)
        choice = scores + self.e_score_correction_bias.float()
        if self.num_groups > 1:
            grouped = choice.unflatten(-1, (self.num_groups, -1))
            # A group's strength is the sum of its two best experts (DeepSeek-V3's noaux_tc rule).
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(-2)
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


class KimiMoE(nn.Module):
    def __init__(self, config: KimiK3TextConfig) -> None:
        super().__init__()
        D, R = config.hidden_size, config.routed_expert_hidden_size
        self.gate = KimiRouter(config)
        expert_width = D if R is None else R
        tp = get_tp_group()
        # Expert parallelism: this rank holds experts [expert_start, expert_start + local); the router still
        # scores all of them, and the choices of other ranks' experts are left to those ranks.
        local = config.num_experts // tp.world_size if tp.expert_parallel else config.num_experts
        self.expert_start = tp.rank * local if tp.expert_parallel else 0
        self.local_experts = local if tp.expert_parallel and tp.world_size > 1 else None
        self.num_experts = config.num_experts
        self.expert_map: torch.Tensor | None = None  # expert parallelism: built on the device after loading
        self.experts = nn.ModuleList(KimiExpert(config, expert_width) for _ in range(local))
        if R is not None:
            # Latent MoE: experts run in a narrower space; shared experts still read the full x.
            self.routed_expert_down_proj = nn.Linear(D, R, bias=False)
            self.routed_expert_up_proj = nn.Linear(R, D, bias=False)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(R, eps=config.rms_norm_eps)
        if config.num_shared_experts:
            # Its partial sum joins the experts' before their one all-reduce (latent MoE: reduced on its own,
            # since the experts' sum is normed in the latent space first).
            self.shared_experts = KimiMLP(config, D, config.moe_intermediate_size * config.num_shared_experts,
                                          reduce_results=R is not None)
        # One shared expert, as wide as a routed one and reading the same x (not latent), split as they are (not
        # expert parallel): the fused kernels run it as expert E with weight 1 (process_weights_after_loading).
        self.shared_in_experts = (config.num_shared_experts == 1 and R is None and self.local_experts is None)
        self.activation = MoEActivation(config.hidden_act, config.activation_situ_beta,
                                        config.activation_situ_linear_beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # capturing_graph: a capture must not sync, so it always takes the kernels (the CPU graph stand-in of the
        # tests reports a capture and runs them through Triton's interpreter).
        fused = (x.is_cuda or capturing_graph(x)) and fused_moe_unsupported(x) is None
        shared_fused = fused and self.shared_in_experts
        weights, ids = self.gate(x, with_shared=shared_fused)
        latent = hasattr(self, "routed_expert_down_proj")
        u = self.routed_expert_down_proj(x) if latent else x
        y = self._routed_fused(u, weights, ids) if fused else self._routed_by_expert(u, weights, ids).to(x.dtype)
        if latent:
            y = tensor_model_parallel_all_reduce(y)
            if hasattr(self, "routed_expert_norm"):
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if hasattr(self, "shared_experts") and not shared_fused:
            y = y + self.shared_experts(x)
        return y if latent else tensor_model_parallel_all_reduce(y)

    def _routed_by_expert(self, u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each expert on the tokens that chose it, one expert at a time: the torch reference, and the CPU path.
        Reads the group sizes on the host (a sync per layer), so it is never used on a GPU where the fused
        kernels run."""
        y = torch.zeros(u.shape, dtype=torch.float32, device=u.device)
        ids = ids if self.expert_map is None else self.expert_map[ids.long()]
        ids = ids.flatten().long()
        skipped = int((ids < 0).sum())  # another rank's experts: sorted first (-1), then passed over
        order = ids.argsort()
        counts = torch.bincount(ids[ids >= 0], minlength=len(self.experts)).tolist()
        tokens, w = order // weights.shape[1], weights.flatten()[order]
        start = skipped
        for e, n in enumerate(counts):
            if n:
                tok = tokens[start:start + n]
                y.index_add_(0, tok, self.experts[e](u[tok]).float() * w[start:start + n, None])
                start += n
        return y

    def process_weights_after_loading(self) -> None:
        """Stacks the experts' weights into one [E, 2I, in] gate/up and one [E, in, I] down tensor and makes each
        expert's parameters views into them (no second copy), for the fused kernels."""
        if hasattr(self, "shared_experts"):
            self.shared_experts.process_weights_after_loading()
        if self.local_experts is not None:
            # upstream's expert_map: global id -> local expert, -1 for another rank's (its choices are skipped)
            ids = torch.arange(self.num_experts, device=self.experts[0].w1.weight.device) - self.expert_start
            self.expert_map = ids.masked_fill((ids < 0) | (ids >= self.local_experts), -1).int()
        inter = self.experts[0].w1.out_features
        pairs = [(e.w1.weight, e.w3.weight, e.w2.weight) for e in self.experts]
        if self.shared_in_experts:
            mlp = self.shared_experts
            pairs.append((mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight))
        self.w13 = torch.stack([torch.cat([w1.data, w3.data]) for w1, w3, _ in pairs])
        self.w2 = torch.stack([w2.data for _, _, w2 in pairs])
        for i, (w1, w3, w2) in enumerate(pairs):  # views into the stacks: no second copy
            w1.data, w3.data, w2.data = self.w13[i, :inter], self.w13[i, inter:], self.w2[i]
        if self.shared_in_experts:
            self.shared_experts.gate_up_weight = self.w13[-1]  # its own forward (the torch path) reads the stack

    def _routed_fused(self, u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The chosen experts only, over tokens sorted by expert on the device (layers/fused_moe): no host sync,
        so the same path runs eagerly, in CUDA graphs and in prefill chunks."""
        if not hasattr(self, "w13"):
            raise RuntimeError("KimiMoE.process_weights_after_loading() must stack the experts before the fused "
                               "MoE runs")
        return fused_experts(u, self.w13, self.w2, weights, ids, self.activation,
                             expert_map=self.expert_map, out_dtype=u.dtype)
