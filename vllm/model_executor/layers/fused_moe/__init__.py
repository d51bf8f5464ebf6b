"""The fused MoE (Triton): routed experts computed over device-sorted (token, expert) pairs."""
from vllm.model_executor.layers.fused_moe.fused_moe import (MoEActivation, fused_experts, fused_moe_unsupported,
                                                            grouped_topk, moe_align_block_size)

__all__ = ["MoEActivation", "fused_experts", "fused_moe_unsupported", "grouped_topk", "moe_align_block_size"]
