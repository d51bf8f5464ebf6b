"""Engine configuration: small dataclasses, each validated once, combined into VllmConfig. The model, cache,
scheduler and kernel configs are here; the parallel, speculative and compilation configs have their own modules
(upstream's vllm/config/ layout), re-exported here.

Errors name the flag, the value and what is allowed, so `vllm serve` and `LLM(...)` fail at construction.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm.config.compilation import CompilationConfig
from vllm.config.parallel import ParallelConfig
from vllm.config.speculative import SpeculativeConfig
from vllm.config.utils import require
from vllm.transformers_utils.configs.kimi_k3 import KimiK3TextConfig
from vllm.transformers_utils.generation_config import eos_token_ids, sampling_defaults

MLA_BACKENDS = ("auto", "TORCH_MLA", "TRITON_MLA", "FLASHINFER_MLA")
KDA_PREFILL_BACKENDS = ("auto", "torch", "triton", "flashkda", "flashinfer")
KDA_DECODE_BACKENDS = ("auto", "torch", "native", "triton", "flashinfer")
LOAD_FORMATS = ("auto", "safetensors", "dummy")  # dummy: random weights from config.json (model_executor/dummy_loader)
STATE_DTYPES = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(slots=True)
class ModelConfig:
    model: str
    tokenizer: str
    dtype: torch.dtype
    seed: int
    max_model_len: int
    hf_config: KimiK3TextConfig
    device: torch.device
    trust_remote_code: bool = False  # the tokenizer may run its checkpoint's own code
    generation_config: str = "auto"  # --generation-config: auto, vllm or a directory
    hf_generation_config: dict = field(default_factory=dict)  # that generation_config.json's fields ({}: none)
    load_format: str = "auto"

    def __post_init__(self) -> None:
        require(self.load_format in LOAD_FORMATS, "--load-format", self.load_format, " or ".join(LOAD_FORMATS))
        limit = self.hf_config.max_position_embeddings
        require(1 <= self.max_model_len <= limit, "--max-model-len", self.max_model_len,
                 f"1 <= value <= the model's max_position_embeddings={limit}")

    def get_diff_sampling_param(self) -> dict:
        """SamplingParams keywords that generation_config.json sets: the defaults of requests that leave them
        unset (upstream's name)."""
        return sampling_defaults(self.hf_generation_config)

    def eos_token_ids(self, tokenizer_eos_token_id: int | None) -> frozenset[int]:
        """Every id that ends a sequence: config.json's, generation_config.json's (a chat model's <|im_end|>) and
        the tokenizer's."""
        ids = set(self.hf_config.eos_token_ids) | set(eos_token_ids(self.hf_generation_config) or [])
        return frozenset(ids | ({tokenizer_eos_token_id} if tokenizer_eos_token_id is not None else set()))


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None  # explicit cache budget (CPU default: 4 GiB)
    mamba_ssm_cache_dtype: torch.dtype = torch.float32
    # Prefix caching (core/prefix_cache.py): MLA blocks reused by hash and KDA state snapshots, taken every
    # `kda_snapshot_interval` tokens while a request decodes (and where a prompt needs one, see docs/prefix_caching.md);
    # `num_kda_snapshots` None: sized with the cache (at most a quarter of it).
    enable_prefix_caching: bool = True
    kda_snapshot_interval: int = 256
    num_kda_snapshots: int | None = None
    # RecoverSSM (--use-replayssm): a speculating request keeps one KDA state, not 1 + K checkpoint columns; verify
    # rows leave per-token records and a commit after sampling advances the state (attention/kda/recover.py).
    use_replayssm: bool = False

    def __post_init__(self) -> None:
        require(self.block_size in (1, 8, 16, 32, 64, 128), "--block-size", self.block_size,
                 "one of 1, 8, 16, 32, 64, 128")
        require(0.0 < self.gpu_memory_utilization <= 1.0, "--gpu-memory-utilization",
                 self.gpu_memory_utilization, "a fraction in (0, 1]")
        require(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
                 "--num-gpu-blocks-override", self.num_gpu_blocks_override, "an integer >= 1")
        require(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0, "--kv-cache-memory-bytes",
                 self.kv_cache_memory_bytes, "a positive number of bytes")
        require(self.kda_snapshot_interval >= self.block_size and self.kda_snapshot_interval % self.block_size == 0,
                 "--kda-snapshot-interval", self.kda_snapshot_interval,
                 f"a positive multiple of --block-size ({self.block_size})")
        require(self.num_kda_snapshots is None or self.num_kda_snapshots >= 0, "--num-kda-snapshots",
                 self.num_kda_snapshots, "an integer >= 0")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0
    # Schedule and prepare step N+1 while the device runs step N (sampled tokens reach the host a step late).
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        require(self.max_num_seqs >= 1, "--max-num-seqs", self.max_num_seqs, "an integer >= 1")
        require(self.max_num_batched_tokens >= 1, "--max-num-batched-tokens", self.max_num_batched_tokens,
                 "an integer >= 1")


@dataclass(slots=True)
class KernelConfig:
    attention_backend: str = "auto"
    kda_prefill_backend: str = "auto"
    kda_decode_backend: str = "auto"

    def __post_init__(self) -> None:
        require(self.attention_backend in MLA_BACKENDS, "--attention-backend", self.attention_backend,
                 f"one of {', '.join(MLA_BACKENDS)}")
        require(self.kda_prefill_backend in KDA_PREFILL_BACKENDS, "--kda-prefill-backend",
                 self.kda_prefill_backend, f"one of {', '.join(KDA_PREFILL_BACKENDS)}")
        require(self.kda_decode_backend in KDA_DECODE_BACKENDS, "--kda-decode-backend", self.kda_decode_backend,
                 f"one of {', '.join(KDA_DECODE_BACKENDS)}")


@dataclass(slots=True)
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    kernel_config: KernelConfig = field(default_factory=KernelConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    speculative_config: SpeculativeConfig | None = None
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        # A verify row is the last token plus K drafts, after at least one prompt token: it must fit the context.
        limit = self.model_config.max_model_len - 2
        require(self.num_speculative_tokens <= limit, "--speculative-config num_speculative_tokens",
                 self.num_speculative_tokens, f"at most --max-model-len - 2 = {limit} (one prompt token, then the "
                 "verified token and its drafts)")
        if self.cache_config.use_replayssm and self.speculative_config is None:
            raise ValueError("--use-replayssm needs speculative decoding (--speculative-config): it replaces the 1 + K "
                             "KDA state checkpoints a speculating request keeps; without drafts there is one already")

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative_config.num_speculative_tokens if self.speculative_config else 0

    @property
    def state_slots_per_request(self) -> int:
        """KDA state slots a running request holds: 1 + K checkpoint columns when speculating, else (and under
        RecoverSSM) one."""
        return 1 if self.cache_config.use_replayssm else 1 + self.num_speculative_tokens

    @property
    def recover_record_len(self) -> int:
        """Tokens per verify row that RecoverSSM records (1 + K), or 0 without it."""
        return 1 + self.num_speculative_tokens if self.cache_config.use_replayssm else 0
