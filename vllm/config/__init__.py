"""Engine configuration: small dataclasses, each validated once, combined into VllmConfig.

Errors name the flag, the value and what is allowed, so `vllm serve` and `LLM(...)` fail at construction.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from vllm.transformers_utils.configs.dspark import DSparkConfig, read_dspark_config
from vllm.transformers_utils.configs.kimi_k3 import KimiK3TextConfig
from vllm.transformers_utils.generation_config import eos_token_ids, sampling_defaults

MLA_BACKENDS = ("auto", "TORCH_MLA", "TRITON_MLA", "FLASHINFER_MLA")
KDA_PREFILL_BACKENDS = ("auto", "torch", "triton", "flashkda", "flashinfer")
KDA_DECODE_BACKENDS = ("auto", "torch", "native", "triton", "flashinfer")
LOAD_FORMATS = ("auto", "safetensors", "dummy")  # dummy: random weights from config.json (model_executor/dummy_loader)
STATE_DTYPES = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}


def _require(ok: bool, flag: str, value, expected: str) -> None:
    if not ok:
        raise ValueError(f"{flag}={value!r} is invalid: expected {expected}")


def parse_json(text: str):
    """json.loads, where nesting too deep for the parser (its RecursionError) is a ValueError like any bad JSON."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("arrays or objects nested too deeply to parse") from None


def _short(text: str, limit: int = 80) -> str:
    """The repr of a flag's text, cut: errors stay one readable line whatever was passed."""
    r = repr(text)
    return r if len(r) <= limit else r[:limit] + f"... ({len(text)} characters)"


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
        _require(self.load_format in LOAD_FORMATS, "--load-format", self.load_format, " or ".join(LOAD_FORMATS))
        limit = self.hf_config.max_position_embeddings
        _require(1 <= self.max_model_len <= limit, "--max-model-len", self.max_model_len,
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
        _require(self.block_size in (1, 8, 16, 32, 64, 128), "--block-size", self.block_size,
                 "one of 1, 8, 16, 32, 64, 128")
        _require(0.0 < self.gpu_memory_utilization <= 1.0, "--gpu-memory-utilization",
                 self.gpu_memory_utilization, "a fraction in (0, 1]")
        _require(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
                 "--num-gpu-blocks-override", self.num_gpu_blocks_override, "an integer >= 1")
        _require(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0, "--kv-cache-memory-bytes",
                 self.kv_cache_memory_bytes, "a positive number of bytes")
        _require(self.kda_snapshot_interval >= self.block_size and self.kda_snapshot_interval % self.block_size == 0,
                 "--kda-snapshot-interval", self.kda_snapshot_interval,
                 f"a positive multiple of --block-size ({self.block_size})")
        _require(self.num_kda_snapshots is None or self.num_kda_snapshots >= 0, "--num-kda-snapshots",
                 self.num_kda_snapshots, "an integer >= 0")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0
    # Schedule and prepare step N+1 while the device runs step N (sampled tokens reach the host a step late).
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "--max-num-seqs", self.max_num_seqs, "an integer >= 1")
        _require(self.max_num_batched_tokens >= 1, "--max-num-batched-tokens", self.max_num_batched_tokens,
                 "an integer >= 1")


@dataclass(slots=True)
class ParallelConfig:
    """Tensor parallelism (`-tp`), over `nnodes` hosts joined at master_addr:master_port (torch.distributed's
    TCP rendezvous); `headless`: this node runs worker ranks only (docs/parallelism.md)."""
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port, on one node
    headless: bool = False

    def __post_init__(self) -> None:
        tp, nnodes = self.tensor_parallel_size, self.nnodes
        _require(_is_int(tp) and tp >= 1, "--tensor-parallel-size", tp, "an integer >= 1")
        _require(_is_int(nnodes) and nnodes >= 1 and tp % nnodes == 0, "--nnodes", nnodes,
                 f"an integer >= 1 that divides --tensor-parallel-size ({tp}): each node runs as many ranks")
        _require(_is_int(self.node_rank) and 0 <= self.node_rank < nnodes, "--node-rank", self.node_rank,
                 f"in [0, --nnodes={nnodes})")
        _require(_is_int(self.master_port) and 0 <= self.master_port < 65536 and (nnodes == 1 or self.master_port),
                 "--master-port", self.master_port, "a TCP port (set on every node when --nnodes > 1)")
        _require(not self.headless or self.node_rank > 0, "--headless", self.headless,
                 "only on nodes other than --node-rank 0 (which runs the engine)")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes


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


SPEC_METHODS_BUILT = ("ngram", "dspark")
SPEC_CONFIG_KEYS = {"ngram": ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"),
                    "dspark": ("method", "num_speculative_tokens", "model", "draft_sample_method",
                               "enable_adaptive_verification")}
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
NGRAM_DEFAULT_PROMPT_LOOKUP_MIN = 1
NGRAM_DEFAULT_PROMPT_LOOKUP_MAX = 4
# Each request owns 1 + K full KDA recurrent states for its whole life (the checkpoint-slot design,
# docs/spec_decode.md) and the native KDA decode kernel unrolls its token loop to 1 + K, so K must stay small;
# acceptance compounds per position, so drafts past a few dozen are never accepted anyway.
MAX_NUM_SPECULATIVE_TOKENS = 32


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(slots=True)
class SpeculativeConfig:
    """`--speculative-config '{"method": "ngram" | "dspark", "num_speculative_tokens": K, ...}'`.

    ngram (prompt lookup): propose up to `num_speculative_tokens` tokens that followed an earlier occurrence of the
    longest suffix n-gram with prompt_lookup_min <= n <= prompt_lookup_max. Defaults differ from upstream on purpose:
    upstream sets min = max = 5 when both are absent and copies one into the other when only one is given; here an
    absent prompt_lookup_min is 1 and an absent prompt_lookup_max is max(4, prompt_lookup_min), so short repeats
    still draft.

    dspark: a DSpark draft checkpoint (`model`, a directory) drafts K tokens per decoding request on the device,
    from the target's hidden states (docs/spec_decode.md). draft_sample_method "greedy" (argmax drafts: exact under
    the rejection sampler for greedy and random requests alike) or "probabilistic" (a random request's drafts are
    sampled from the draft's distribution at the request's temperature, which the rejection sampler then takes
    as q: more drafts accepted where the target is not peaked; greedy requests still draft the argmax).
    enable_adaptive_verification: each all-verify step verifies only the draft tokens worth their cost
    (vllm/spec_decode/adaptive_verification/).
    """
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    draft_sample_method: str = "greedy"
    enable_adaptive_verification: bool = False
    draft_config: DSparkConfig | None = field(default=None, repr=False)  # read from `model` (dspark)

    def __post_init__(self) -> None:
        flag = "--speculative-config"
        _require(self.method in SPEC_METHODS_BUILT, f"{flag} method", self.method,
                 f"one of {', '.join(map(repr, SPEC_METHODS_BUILT))}")
        _require(_is_int(self.num_speculative_tokens)
                 and 1 <= self.num_speculative_tokens <= MAX_NUM_SPECULATIVE_TOKENS,
                 f"{flag} num_speculative_tokens", self.num_speculative_tokens,
                 f"an integer in [1, {MAX_NUM_SPECULATIVE_TOKENS}] (each request keeps 1 + K KDA state checkpoints)")
        if self.method == "dspark":
            self._check_dspark(flag)
            return
        if self.prompt_lookup_min is None:
            self.prompt_lookup_min = NGRAM_DEFAULT_PROMPT_LOOKUP_MIN
        _require(_is_int(self.prompt_lookup_min) and self.prompt_lookup_min >= 1,
                 f"{flag} prompt_lookup_min", self.prompt_lookup_min, "an integer >= 1")
        if self.prompt_lookup_max is None:
            self.prompt_lookup_max = max(NGRAM_DEFAULT_PROMPT_LOOKUP_MAX, self.prompt_lookup_min)
        _require(_is_int(self.prompt_lookup_max) and self.prompt_lookup_max >= self.prompt_lookup_min,
                 f"{flag} prompt_lookup_max", self.prompt_lookup_max,
                 f"an integer >= prompt_lookup_min={self.prompt_lookup_min}")

    def _check_dspark(self, flag: str) -> None:
        _require(isinstance(self.model, str) and self.model, f"{flag} model", self.model,
                 "the directory of a DSpark draft checkpoint (method 'dspark' needs one)")
        _require(self.draft_sample_method in DRAFT_SAMPLE_METHODS, f"{flag} draft_sample_method",
                 self.draft_sample_method, f"one of {', '.join(map(repr, DRAFT_SAMPLE_METHODS))}")
        _require(isinstance(self.enable_adaptive_verification, bool), f"{flag} enable_adaptive_verification",
                 self.enable_adaptive_verification, "true or false")
        self.draft_config = read_dspark_config(self.model)

    @classmethod
    def from_json(cls, text_or_dict: str | dict) -> SpeculativeConfig:
        """Build from the `--speculative-config` JSON text or an already-parsed dict."""
        flag = "--speculative-config"
        if isinstance(text_or_dict, str):
            try:
                data = parse_json(text_or_dict)
            except ValueError as e:
                raise ValueError(f"{flag}={_short(text_or_dict)} is not valid JSON: {e}") from None
        else:
            data = text_or_dict
        _require(isinstance(data, dict), flag, text_or_dict, 'a JSON object such as {"method": "ngram", '
                 '"num_speculative_tokens": 3}')
        _require("method" in data, flag, data, f"a 'method' key (one of {', '.join(map(repr, SPEC_METHODS_BUILT))})")
        _require(data["method"] in SPEC_CONFIG_KEYS, f"{flag} method", data["method"],
                 f"one of {', '.join(map(repr, SPEC_METHODS_BUILT))}")
        keys = SPEC_CONFIG_KEYS[data["method"]]
        unknown = sorted(k for k in data if k not in keys)
        _require(not unknown, f"{flag} keys", unknown, f"for method {data['method']!r} only the keys {', '.join(keys)}")
        _require("num_speculative_tokens" in data, flag, data, "a 'num_speculative_tokens' key (an integer >= 1)")
        return cls(**data)


CUDAGRAPH_MODES = ("NONE", "FULL_DECODE_ONLY", "FULL", "PIECEWISE", "FULL_AND_PIECEWISE")
COMPILATION_CONFIG_KEYS = ("cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size")


@dataclass(slots=True)
class CompilationConfig:
    """`--compilation-config '{"cudagraph_mode": ..., "cudagraph_capture_sizes": [...]}'` and `--enforce-eager`.

    cudagraph_mode: NONE (eager), FULL_DECODE_ONLY (graphs for decode/verify batches, eager for any batch with a
    prefill row), FULL (graphs for mixed batches too, only if every backend is ALWAYS), PIECEWISE (every step of up
    to 512 tokens replays graphs of the pieces between attention cores, which run eagerly: worker/piecewise.py) or
    FULL_AND_PIECEWISE (full graphs for decode/verify batches, pieces for the rest: upstream's default, and ours on
    CUDA). The graphs' memory pool is measured before the cache is sized and left out of it.
    Capture sizes are token counts; None picks 1, 2, 4, 8 and multiples of 8 up to max_cudagraph_capture_size
    (None: what a full decode batch can take, max_num_seqs x (1 + num_speculative_tokens), within the token
    budget), rounded to multiples of 1 + num_speculative_tokens by the runner. `enforce_eager` forces NONE.
    """
    enforce_eager: bool = False
    cudagraph_mode: str | None = None  # None: FULL_AND_PIECEWISE on CUDA, NONE elsewhere
    cudagraph_capture_sizes: list[int] | None = None
    max_cudagraph_capture_size: int | None = None

    def __post_init__(self) -> None:
        flag = "--compilation-config"
        _require(self.cudagraph_mode is None or self.cudagraph_mode in CUDAGRAPH_MODES, f"{flag} cudagraph_mode",
                 self.cudagraph_mode, f"one of {', '.join(CUDAGRAPH_MODES)}")
        sizes = self.cudagraph_capture_sizes
        _require(sizes is None or (isinstance(sizes, list) and all(_is_int(n) and n >= 1 for n in sizes)),
                 f"{flag} cudagraph_capture_sizes", sizes, "a list of token counts >= 1")
        _require(self.max_cudagraph_capture_size is None
                 or (_is_int(self.max_cudagraph_capture_size) and self.max_cudagraph_capture_size >= 1),
                 f"{flag} max_cudagraph_capture_size", self.max_cudagraph_capture_size, "an integer >= 1")
        if sizes is not None:
            self.cudagraph_capture_sizes = sorted(set(sizes))

    @classmethod
    def from_json(cls, text_or_dict: str | dict | None, enforce_eager: bool = False) -> CompilationConfig:
        flag = "--compilation-config"
        data = text_or_dict or {}
        if isinstance(data, str):
            try:
                data = parse_json(data)
            except ValueError as e:
                raise ValueError(f"{flag}={_short(text_or_dict)} is not valid JSON: {e}") from None
        _require(isinstance(data, dict), flag, text_or_dict, 'a JSON object such as {"cudagraph_mode": "FULL"}')
        unknown = sorted(k for k in data if k not in COMPILATION_CONFIG_KEYS)
        _require(not unknown, f"{flag} keys", unknown, f"only the keys {', '.join(COMPILATION_CONFIG_KEYS)}")
        return cls(enforce_eager=enforce_eager, **data)

    def resolved_mode(self, device: torch.device) -> str:
        """The mode asked for: NONE under --enforce-eager or off CUDA, else the flag (FULL_AND_PIECEWISE when unset)."""
        if self.enforce_eager or device.type != "cuda":
            return "NONE"
        return self.cudagraph_mode or "FULL_AND_PIECEWISE"


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
        _require(self.num_speculative_tokens <= limit, "--speculative-config num_speculative_tokens",
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
