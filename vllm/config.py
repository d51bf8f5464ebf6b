"""Engine configuration: small dataclasses, each validated once, combined into VllmConfig.

Errors name the flag, the value and what is allowed, so `vllm serve` and `LLM(...)` fail at construction.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm.model_executor.models.kimi_k3.config import KimiK3TextConfig

MLA_BACKENDS = ("auto", "TORCH_MLA", "TRITON_MLA", "FLASHINFER_MLA")
KDA_PREFILL_BACKENDS = ("auto", "torch", "triton", "flashkda", "flashinfer")
KDA_DECODE_BACKENDS = ("auto", "torch", "native", "triton", "flashinfer")
STATE_DTYPES = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}


def _require(ok: bool, flag: str, value, expected: str) -> None:
    if not ok:
        raise ValueError(f"{flag}={value!r} is invalid: expected {expected}")


@dataclass(slots=True)
class ModelConfig:
    model: str
    tokenizer: str
    dtype: torch.dtype
    seed: int
    max_model_len: int
    hf_config: KimiK3TextConfig
    device: torch.device

    def __post_init__(self) -> None:
        limit = self.hf_config.max_position_embeddings
        _require(1 <= self.max_model_len <= limit, "--max-model-len", self.max_model_len,
                 f"1 <= value <= the model's max_position_embeddings={limit}")


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None  # explicit cache budget (CPU default: 4 GiB)
    mamba_ssm_cache_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        _require(self.block_size in (1, 8, 16, 32, 64, 128), "--block-size", self.block_size,
                 "one of 1, 8, 16, 32, 64, 128")
        _require(0.0 < self.gpu_memory_utilization <= 1.0, "--gpu-memory-utilization",
                 self.gpu_memory_utilization, "a fraction in (0, 1]")
        _require(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
                 "--num-gpu-blocks-override", self.num_gpu_blocks_override, "an integer >= 1")
        _require(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0, "--kv-cache-memory-bytes",
                 self.kv_cache_memory_bytes, "a positive number of bytes")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "--max-num-seqs", self.max_num_seqs, "an integer >= 1")
        _require(self.max_num_batched_tokens >= 1, "--max-num-batched-tokens", self.max_num_batched_tokens,
                 "an integer >= 1")


@dataclass(slots=True)
class KernelConfig:
    attention_backend: str = "auto"
    kda_prefill_backend: str = "auto"
    kda_decode_backend: str = "auto"

    def __post_init__(self) -> None:
        _require(self.attention_backend in MLA_BACKENDS, "--attention-backend", self.attention_backend,
                 f"one of {', '.join(MLA_BACKENDS)}")
        _require(self.kda_prefill_backend in KDA_PREFILL_BACKENDS, "--kda-prefill-backend",
                 self.kda_prefill_backend, f"one of {', '.join(KDA_PREFILL_BACKENDS)}")
        _require(self.kda_decode_backend in KDA_DECODE_BACKENDS, "--kda-decode-backend", self.kda_decode_backend,
                 f"one of {', '.join(KDA_DECODE_BACKENDS)}")


@dataclass(slots=True)
class CompilationConfig:
    enforce_eager: bool = False


@dataclass(slots=True)
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    kernel_config: KernelConfig = field(default_factory=KernelConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
