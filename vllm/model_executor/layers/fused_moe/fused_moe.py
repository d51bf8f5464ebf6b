"""fused_experts: the routed experts of a MoE layer as three Triton launches that read only the chosen experts.

1. `moe_align_block_size`: the (token, expert) pairs grouped by expert on the device (one launch);
2. gate/up GEMM with the gated activation fused, over the sorted pairs (one launch; or, where the tuned tiles
   say `split_act`, one GEMM over all 2I columns and the activation after it: two launches);
3. down GEMM scaled by the routing weights (one launch), then a sum over each token's top_k rows (one launch, in
   float32, rounded once to the caller's dtype).

A shared expert as wide as a routed one can ride along as expert E, chosen by every token with weight 1
(grouped_topk's `with_shared`): its GEMMs, activation and add then cost no launches of their own.

No step reads a tensor on the host and every grid is sized from shapes alone, so the same path serves eager
steps, CUDA graphs and prefill chunks of any size; the old every-expert-on-every-token graph path read all
experts' weights every step and the per-expert loop synced per layer.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from vllm.model_executor.layers.fused_moe.tile_configs import GemmConfig, tuned_config
from vllm.utils import num_sms

try:
    from vllm.model_executor.layers.fused_moe import kernels
    _IMPORT_ERROR = None
except ImportError as e:  # fused_moe_unsupported() reports it; CPU installs route experts with torch
    kernels, _IMPORT_ERROR = None, e

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ALIGN_CHUNK = 1024
_DEFAULT_SMEM_BYTES = 232_448  # H100/H200's shared memory per block (opt-in), where no GPU is visible


@dataclass(frozen=True, slots=True)
class MoEActivation:
    """The experts' gated activation: "silu" (Kimi-Linear) or "situ" (Kimi-K3, with its two soft caps)."""
    name: str = "silu"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0

    def __post_init__(self) -> None:
        if self.name not in ("silu", "situ"):
            raise ValueError(f"fused MoE activation {self.name!r} is not supported; expected 'silu' or 'situ'")


def fused_moe_unsupported(x: torch.Tensor) -> str | None:
    """Why the fused kernels cannot run on x (None when they can)."""
    if _IMPORT_ERROR is not None:
        return f"fused MoE needs triton, which failed to import: {_IMPORT_ERROR}"
    if x.dtype not in _SUPPORTED_DTYPES:
        return f"fused MoE needs bfloat16, float16 or float32 activations, got {x.dtype}"
    return None


def pick_config(num_pairs: int, num_experts: int, inter: int, hidden: int, num_sms: int, elem_size: int = 2,
                smem_bytes: int = _DEFAULT_SMEM_BYTES) -> tuple[GemmConfig, GemmConfig]:
    """Tiles for the gate/up GEMM (N = inter) and the down GEMM (N = hidden), with one BLOCK_M: both read the
    same sorted layout. Chosen by the sweep of benchmarks/kernels/bench_fused_moe.py on the H200 for 2-byte
    activations, then fitted to the device's shared memory (`fit_shared_memory`): float32 tiles are twice the
    bytes, and the prefill tiles in float32 need 288 KiB where the H200 has 227.

    Decode-sized routings (a few pairs per expert) are bandwidth-bound: BLOCK_M 16 wastes few padded rows, and
    BLOCK_N narrows (down to 32 / 64) until the chosen experts' weights spread over about two programs per SM:
    at one token of the 1.3B config that took the layer from 26 to 20 us. Prefill-sized routings are
    compute-bound and take the biggest tiles that fit (8,192 tokens: 746 us against 876 with 64-row tiles)."""
    if num_pairs <= 16 * num_experts:
        active_blocks = min(num_pairs, num_experts)

        def narrow(n: int, widest: int, narrowest: int) -> int:
            block_n = widest
            while block_n > narrowest and active_blocks * _cdiv(n, block_n) < 2 * num_sms:
                block_n //= 2
            return block_n
        up, down = GemmConfig(16, narrow(inter, 64, 32), 128, 4, 4), GemmConfig(16, narrow(hidden, 128, 64), 128, 4, 4)
    elif num_pairs <= 64 * num_experts:
        up, down = GemmConfig(32, 64, 64, 4, 4), GemmConfig(32, 128, 64, 4, 4)
    else:
        up, down = GemmConfig(128, 128, 64, 8, 4), GemmConfig(128, 256, 64, 8, 4)
    return (fit_shared_memory(up, 2, elem_size, smem_bytes), fit_shared_memory(down, 1, elem_size, smem_bytes))


def choose_tiles(tokens: int, top_k: int, num_experts: int, inter: int, hidden: int, x: torch.Tensor
                 ) -> tuple[GemmConfig, GemmConfig]:
    """The tuned tiles for this shape on this device (tile_configs), else the heuristic; both fitted to the
    device's shared memory."""
    smem = smem_per_block(x.device)
    tuned = tuned_config(tokens, num_experts, inter, hidden, x.dtype, x.device)
    if tuned is None:
        return pick_config(tokens * top_k, num_experts, inter, hidden, num_sms(x.device), x.element_size(), smem)
    up, down = tuned
    return (fit_shared_memory(up, up_b_tiles(up), x.element_size(), smem),
            fit_shared_memory(down, 1, x.element_size(), smem))


def up_b_tiles(cfg: GemmConfig) -> int:
    """B tiles the gate/up kernel loads per step: a gate and an up tile fused, one of the 2I columns split."""
    return 1 if cfg.split_act else 2


def pipelined_smem_bytes(cfg: GemmConfig, b_tiles: int, elem_size: int) -> int:
    """Shared memory of a software-pipelined GEMM loop: num_stages - 1 buffers in flight, each one A tile
    [BLOCK_M, BLOCK_K] and `b_tiles` B tiles [BLOCK_K, BLOCK_N] (the gate/up kernel loads a gate and an up
    tile): for float32 (128, 128, 64) gate/up tiles at 4 stages, 294,912 bytes, past the H200's 232,448."""
    return (cfg.num_stages - 1) * (cfg.block_m * cfg.block_k + b_tiles * cfg.block_k * cfg.block_n) * elem_size


def fit_shared_memory(cfg: GemmConfig, b_tiles: int, elem_size: int, smem_bytes: int) -> GemmConfig:
    """`cfg` with fewer pipeline stages (down to 2), then narrower BLOCK_K (down to 16), until its buffers fit
    in `smem_bytes`; a config that fits already is returned as it is."""
    while pipelined_smem_bytes(cfg, b_tiles, elem_size) > smem_bytes:
        if cfg.num_stages > 2:
            cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_k > 16:
            cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
        else:
            break
    return cfg


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@functools.lru_cache
def smem_per_block(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SMEM_BYTES
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs grouped by expert, each expert's run padded to whole BLOCK_M blocks.

    Returns (sorted_pairs [max_blocks * block_m] int32, pair ids with num_pairs as padding; block_expert
    [max_blocks] int32; num_padded [1] int32, the rows in use). max_blocks is the most any routing of these
    shapes can need: every expert with pairs wastes less than one block."""
    ids = topk_ids.flatten()
    num_pairs = ids.numel()
    max_blocks = _cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=ids.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=ids.device)
    kernels._align_kernel[(num_experts,)](
        ids, sorted_pairs, block_expert, num_padded, num_pairs, num_experts, BLOCK_M=block_m,
        E_POW2=_next_power_of_2(num_experts), CHUNK=min(_ALIGN_CHUNK, _next_power_of_2(num_pairs)))
    return sorted_pairs, block_expert, num_padded


def grouped_topk(router_logits: torch.Tensor, bias: torch.Tensor, top_k: int, num_groups: int = 1,
                 topk_group: int = 1, renormalize: bool = True, scale: float = 1.0, with_shared: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sigmoid router's choice in one launch (what KimiRouter does in ~9 torch kernels): router_logits
    [T, E] float32 and the e_score_correction_bias [E] float32 -> (weights [T, top_k] float32, ids [T, top_k]
    int32, the dtype the align kernel reads), experts in descending order of score + bias. `with_shared`: one
    more column, expert E with weight 1 (a shared expert stacked after the routed ones: fused_experts runs it
    with them)."""
    T, E = router_logits.shape
    if router_logits.dtype != torch.float32 or bias.dtype != torch.float32:
        raise ValueError(f"grouped_topk takes float32 logits and bias, got {router_logits.dtype}, {bias.dtype}")
    if E % num_groups or not top_k <= topk_group * (E // num_groups):
        raise ValueError(f"grouped_topk: {E} experts in {num_groups} groups cannot give top_k={top_k} from "
                         f"topk_group={topk_group} groups")
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty(T, top_k + with_shared, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k + with_shared, dtype=torch.int32, device=logits.device)
    if T:
        kernels._grouped_topk_kernel[(T,)](
            logits, bias.contiguous(), weights, ids, logits.stride(0), E, scale, TOP_K=top_k,
            K_POW2=_next_power_of_2(top_k), NUM_GROUPS=num_groups, G_POW2=_next_power_of_2(num_groups),
            TOPK_GROUP=topk_group, RENORMALIZE=renormalize, E_POW2=_next_power_of_2(E), SHARED=int(with_shared),
            num_warps=1 if E <= 128 else 4)
    return weights, ids


def _expert_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, weights: torch.Tensor,
                 sorted_pairs: torch.Tensor, block_expert: torch.Tensor, num_padded: torch.Tensor, cfg: GemmConfig,
                 precision: str, a_row_div: int, scale: bool) -> None:
    """out[pair] = a[pair // a_row_div] . w[expert]^T (times the pair's routing weight with `scale`)."""
    N, K = w.shape[1], w.shape[2]
    kernels._expert_gemm_kernel[(block_expert.numel(), _cdiv(N, cfg.block_n))](
        a, w, out, weights, sorted_pairs, block_expert, num_padded, out.shape[0], K, N,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0), A_ROW_DIV=a_row_div, SCALE=scale,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: MoEActivation = MoEActivation(),
                  tiles: tuple[GemmConfig, GemmConfig] | None = None,
                  expert_map: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]), [T, D] in out_dtype (summed in float32: another
    dtype saves the caller a cast launch).

    x [T, D]; w13 [E, 2I, D] (gate rows, then up rows); w2 [E, D, I]; topk_weights [T, k] float32;
    topk_ids [T, k] integer. `tiles` (gate/up, down) overrides the choice (tile_configs' table for the shape and
    device, else pick_config): the tuner's seam. `expert_map` (upstream's, for expert parallelism): the global
    id -> this rank's local expert, or -1 for another rank's, whose choices are skipped (they add nothing here)."""
    reason = fused_moe_unsupported(x)
    if reason:
        raise ValueError(reason)
    T, D = x.shape
    E, two_i, _ = w13.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    num_pairs = T * top_k
    if num_pairs == 0:
        return torch.zeros(T, D, dtype=out_dtype, device=x.device)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    weights = topk_weights.flatten().float().contiguous()
    up_cfg, down_cfg = tiles or choose_tiles(T, top_k, E, inter, D, x)
    ids = topk_ids.to(torch.int32) if expert_map is None else expert_map[topk_ids.long()].to(torch.int32)
    sorted_pairs, block_expert, num_padded = moe_align_block_size(ids, up_cfg.block_m, E)
    max_blocks = block_expert.numel()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    act_id = kernels.ACT_SITU if activation.name == "situ" else kernels.ACT_SILU
    if up_cfg.split_act:
        # A skipped choice's gate/up row is never written, and its activation never read.
        gate_up = torch.empty(num_pairs, two_i, dtype=x.dtype, device=x.device)
        _expert_gemm(x, w13, gate_up, weights, sorted_pairs, block_expert, num_padded, up_cfg, precision,
                     a_row_div=top_k, scale=False)
        block = min(1024, _next_power_of_2(inter))
        kernels._act_kernel[(num_pairs, _cdiv(inter, block))](
            gate_up, act, inter, gate_up.stride(0), act.stride(0), activation.situ_beta, activation.situ_linear_beta,
            ACT=act_id, BLOCK=block, LIBDEVICE=x.is_cuda, num_warps=4)
    else:
        kernels._gate_up_act_kernel[(max_blocks, _cdiv(inter, up_cfg.block_n))](
            x, w13, act, sorted_pairs, block_expert, num_padded, num_pairs, D, inter,
            x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), activation.situ_beta,
            activation.situ_linear_beta, TOP_K=top_k, ACT=act_id,
            BLOCK_M=up_cfg.block_m, BLOCK_N=up_cfg.block_n, BLOCK_K=up_cfg.block_k, PRECISION=precision,
            LIBDEVICE=x.is_cuda, num_warps=up_cfg.num_warps, num_stages=up_cfg.num_stages)
    # a skipped choice's row is never written: zero, so the sum over choices holds
    out = (torch.empty if expert_map is None else torch.zeros)(num_pairs, D, dtype=x.dtype, device=x.device)
    _expert_gemm(act, w2, out, weights, sorted_pairs, block_expert, num_padded, down_cfg, precision,
                 a_row_div=1, scale=True)
    y = torch.empty(T, D, dtype=out_dtype, device=x.device)
    block_d = min(1024, _next_power_of_2(D))
    kernels._moe_sum_kernel[(T, _cdiv(D, block_d))](out, y, D, out.stride(0), y.stride(0), TOP_K=top_k,
                                                     BLOCK_D=block_d, num_warps=4)
    return y
