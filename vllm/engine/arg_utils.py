"""EngineArgs: every engine flag once (upstream names), with argparse wiring and the config it builds."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import reprlib
import typing
from dataclasses import dataclass

import torch

from vllm.assets import DEFAULT_MODEL_DIR
from vllm.engine.arg_compat import ENGINE_ARGS, add_upstream_args, check_upstream_args, json_text
from vllm.config import (KDA_DECODE_BACKENDS, KDA_PREFILL_BACKENDS, LOAD_FORMATS, MLA_BACKENDS, STATE_DTYPES,
                         CacheConfig, CompilationConfig, KernelConfig, ModelConfig, ParallelConfig,
                         SchedulerConfig, SpeculativeConfig, VllmConfig)
from vllm.model_executor.model_loader import load_config, read_config_json, resolve_dtype
from vllm.model_executor.tp_shard import check_divisible
from vllm.transformers_utils.generation_config import log_defaults, read_generation_config

DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float")  # half, float: upstream's aliases
CPU_KV_CACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # GiB, as upstream's CPU backend


# Default token budget per step, by device: on a GPU each prefill step has a fixed cost (launches, per-layer
# host work), so chunks of 8192 tokens (upstream's server default) cut the time to first token of long prompts;
# on a CPU smaller steps keep decode latency down.
DEFAULT_BATCHED_TOKENS = {"cuda": 8192, "cpu": 2048}


@dataclass
class EngineArgs:
    model: str | os.PathLike = str(DEFAULT_MODEL_DIR)
    tokenizer: str | os.PathLike | None = None
    dtype: str | torch.dtype = "auto"
    seed: int = 0
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = 256  # None: the default, as upstream
    max_num_batched_tokens: int | None = None  # None: 8192 on CUDA, 2048 on CPU (DEFAULT_BATCHED_TOKENS)
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    kda_snapshot_interval: int = 256
    num_kda_snapshots: int | None = None
    use_replayssm: bool = False
    enforce_eager: bool = False
    mamba_ssm_cache_dtype: str = "float32"
    attention_backend: str = "auto"
    kda_prefill_backend: str = "auto"
    kda_decode_backend: str = "auto"
    speculative_config: str | dict | None = None  # JSON text (CLI) or a dict (LLM(...))
    compilation_config: str | dict | None = None
    async_scheduling: bool | None = None  # None: on for CUDA unless ngram speculates
    trust_remote_code: bool = False
    generation_config: str | os.PathLike = "auto"  # auto: the model's generation_config.json; vllm: none; or a dir
    load_format: str = "auto"  # auto/safetensors: the checkpoint; dummy: random weights from config.json
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    headless: bool = False

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("model", "tokenizer", "generation_config"):  # paths as the configs hold them: text
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        d = EngineArgs
        g = parser.add_argument_group("engine")
        g.add_argument("--model", default=d.model, help="model directory (default: the built-in tiny Kimi-K3)")
        g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model directory)")
        g.add_argument("--trust-remote-code", action="store_true",
                       help="run the tokenizer's own Python code from its directory (tokenizer_config.json's "
                            "auto_map), as the published Kimi checkpoints' TikToken tokenizers need")
        g.add_argument("--generation-config", default=d.generation_config,
                       help="where default sampling parameters and extra eos ids come from: 'auto' (the model's "
                            "generation_config.json, if any), 'vllm' (none) or a directory holding one")
        g.add_argument("--load-format", default=d.load_format, choices=LOAD_FORMATS,
                       help="'auto' or 'safetensors': the model directory's weights; 'dummy': random weights from "
                            "its config.json alone (benchmarks at a model's real shape, no checkpoint on disk)")
        g.add_argument("--dtype", default=d.dtype, choices=DTYPES, help="weights and activations dtype")
        g.add_argument("--seed", type=int, default=d.seed)
        g.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
        g.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output in tokens (default: the model's max_position_embeddings)")
        g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="max requests per step")
        g.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="token budget per step; longer prompts are prefilled in chunks (default: 8192 on "
                            "CUDA, where big chunks keep prefill compute-bound, 2048 on CPU)")
        g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                       help="fraction of GPU memory the engine may use (weights, activations and cache)")
        g.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                       help=f"cache budget in bytes (overrides the GPU fraction; on CPU the default is "
                            f"${CPU_KV_CACHE_SPACE_ENV} GiB, else 4 GiB)")
        g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per MLA latent-cache block")
        g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                       help="force the number of MLA cache blocks (tests use it to force preemption)")
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=d.enable_prefix_caching,
                       help="reuse the cache of prompt prefixes seen before (MLA blocks by hash, KDA state "
                            "snapshots); on by default, as upstream")
        g.add_argument("--kda-snapshot-interval", type=int, default=d.kda_snapshot_interval,
                       help="tokens between the KDA state snapshots a decoding request leaves for prefix caching "
                            "(a multiple of --block-size): a later turn recomputes at most this many of its history")
        g.add_argument("--num-kda-snapshots", type=int, default=None,
                       help="KDA state snapshot slots for prefix caching (default: 4 per --max-num-seqs request, at "
                            "most a quarter of the cache budget; at most 64 on a CPU)")
        g.add_argument("--use-replayssm", action="store_true",
                       help="RecoverSSM: a speculating request keeps one KDA state instead of 1 + K checkpoints; "
                            "verify rows record per-token corrections and one launch commits the accepted ones "
                            "(needs --speculative-config)")
        g.add_argument("--enforce-eager", action="store_true", help="never use CUDA graphs")
        g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="schedule and prepare each step while the GPU runs the one before (default: on with "
                            "CUDA unless --speculative-config is given, whose drafts need the tokens of the step "
                            "before on the host)")
        g.add_argument("--mamba-ssm-cache-dtype", default=d.mamba_ssm_cache_dtype, choices=sorted(STATE_DTYPES),
                       help="dtype of the KDA recurrent state pools")
        g.add_argument("--attention-backend", default=d.attention_backend, choices=MLA_BACKENDS,
                       help="MLA backend")
        g.add_argument("--kda-prefill-backend", default=d.kda_prefill_backend, choices=KDA_PREFILL_BACKENDS)
        g.add_argument("--kda-decode-backend", default=d.kda_decode_backend, choices=KDA_DECODE_BACKENDS)
        g.add_argument("--speculative-config", default=None, type=json_text,
                       help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
                            '"prompt_lookup_max": 4}\'')
        g.add_argument("--compilation-config", "-O", default=None, type=json_text,
                       help='JSON, e.g. \'{"cudagraph_mode": "FULL_DECODE_ONLY", '
                            '"cudagraph_capture_sizes": [1, 2, 4]}\'')
        p = parser.add_argument_group("parallelism (docs/parallelism.md)")
        p.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                       help="ranks the model is split over (one process each; heads, widths and vocabulary split)")
        p.add_argument("--enable-expert-parallel", "-ep", action="store_true",
                       help="MoE layers: each rank holds whole experts instead of a slice of every expert")
        p.add_argument("--nnodes", type=int, default=d.nnodes, help="hosts the ranks run on")
        p.add_argument("--node-rank", type=int, default=d.node_rank, help="this host's index (0 runs the engine)")
        p.add_argument("--master-addr", default=d.master_addr, help="node 0's address for the rendezvous")
        p.add_argument("--master-port", type=int, default=d.master_port,
                       help="node 0's rendezvous port (default on one node: a free one)")
        p.add_argument("--headless", action="store_true", help="run this node's worker ranks only (node rank > 0)")
        add_upstream_args(g, ENGINE_ARGS)  # hidden from --help: see vllm/engine/arg_compat.py
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        check_upstream_args({name: getattr(args, name) for name in ENGINE_ARGS if getattr(args, name, None)
                             is not None})
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> EngineArgs:
        """`LLM(...)`'s keywords: ours, then upstream's others (arg_compat), anything else refused by name."""
        upstream = {k: v for k, v in kwargs.items() if k in ENGINE_ARGS}
        unknown = set(kwargs) - set(upstream) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown engine arguments {sorted(unknown)}; see EngineArgs for the accepted ones")
        check_upstream_args(upstream)
        return cls(**{k: v for k, v in kwargs.items() if k not in upstream})

    def create_engine_config(self) -> VllmConfig:
        raw = read_config_json(self.model)
        hf_config = load_config(self.model, raw)
        device = self._device()
        if self.mamba_ssm_cache_dtype not in STATE_DTYPES:
            raise ValueError(f"--mamba-ssm-cache-dtype={self.mamba_ssm_cache_dtype!r} is invalid: expected one of "
                             f"{', '.join(sorted(STATE_DTYPES))}")
        if self.max_model_len is not None and (isinstance(self.max_model_len, bool)
                                               or not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ValueError(f"--max-model-len must be an integer >= 1 (or unset for the model's "
                             f"{hf_config.max_position_embeddings}), got {self.max_model_len!r}")
        max_model_len = self.max_model_len or hf_config.max_position_embeddings
        generation = read_generation_config(self.model, self.generation_config)
        model_config = ModelConfig(model=self.model, tokenizer=self.tokenizer or self.model,
                                   dtype=resolve_dtype(self.dtype, raw), seed=self.seed, max_model_len=max_model_len,
                                   hf_config=hf_config, device=device, trust_remote_code=bool(self.trust_remote_code),
                                   generation_config=self.generation_config, hf_generation_config=generation,
                                   load_format=self.load_format)
        extra_eos = sorted(model_config.eos_token_ids(None) - set(hf_config.eos_token_ids))
        log_defaults(self.model if self.generation_config == "auto" else self.generation_config,
                     model_config.get_diff_sampling_param(), extra_eos)
        spec = None if self.speculative_config is None else SpeculativeConfig.from_json(self.speculative_config)
        async_scheduling = self._async_scheduling(device, spec)
        kv_bytes = self.kv_cache_memory_bytes
        if kv_bytes is None and device.type == "cpu":
            kv_bytes = int(float(os.environ.get(CPU_KV_CACHE_SPACE_ENV, "4")) * (1 << 30))
        return VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(block_size=self.block_size, gpu_memory_utilization=self.gpu_memory_utilization,
                                     num_gpu_blocks_override=self.num_gpu_blocks_override,
                                     kv_cache_memory_bytes=kv_bytes,
                                     mamba_ssm_cache_dtype=STATE_DTYPES[self.mamba_ssm_cache_dtype],
                                     enable_prefix_caching=self.enable_prefix_caching,
                                     kda_snapshot_interval=self.kda_snapshot_interval,
                                     num_kda_snapshots=self.num_kda_snapshots,
                                     use_replayssm=self.use_replayssm),
            scheduler_config=SchedulerConfig(max_num_seqs=EngineArgs.max_num_seqs if self.max_num_seqs is None
                                             else self.max_num_seqs,  # None: the default, as upstream
                                             max_num_batched_tokens=self.max_num_batched_tokens
                                             or DEFAULT_BATCHED_TOKENS[device.type],
                                             max_model_len=max_model_len, async_scheduling=async_scheduling),
            kernel_config=KernelConfig(self.attention_backend, self.kda_prefill_backend, self.kda_decode_backend),
            compilation_config=CompilationConfig.from_json(self.compilation_config, self.enforce_eager),
            speculative_config=spec,
            parallel_config=self._parallel(hf_config),
        )

    def _parallel(self, hf_config) -> ParallelConfig:
        parallel = ParallelConfig(self.tensor_parallel_size, self.enable_expert_parallel, self.nnodes,
                                  self.node_rank, self.master_addr, self.master_port, self.headless)
        check_divisible(hf_config, parallel.tensor_parallel_size, parallel.enable_expert_parallel)
        return parallel

    def _async_scheduling(self, device: torch.device, spec: SpeculativeConfig | None) -> bool:
        ngram = spec is not None and spec.method == "ngram"
        if self.async_scheduling is None:
            return device.type == "cuda" and not ngram
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be true, false or unset, got {self.async_scheduling!r}")
        if self.async_scheduling and ngram:
            raise ValueError("--async-scheduling cannot be combined with ngram speculation: the ngram proposer drafts "
                             "on the host from the tokens of the step before, which are still on the device when the "
                             "next step is scheduled; drop one of the two flags, or use DSpark drafts (proposed on "
                             "the device)")
        return self.async_scheduling

    def _device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device=cuda was asked for but torch sees no CUDA device on this machine")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device={self.device!r} is invalid: expected auto, cpu or cuda")
        return torch.device(self.device)


_SHORT = reprlib.Repr()  # a value shown in an error: cut, and safe on deep nesting
_SHORT.maxstring = _SHORT.maxother = 80


@functools.cache
def _field_types(cls: type) -> dict[str, tuple[type, ...]]:
    """Each dataclass field's accepted types, from its annotation (`int | None` -> (int, NoneType))."""
    hints = typing.get_type_hints(cls)
    return {f.name: typing.get_args(hints[f.name]) or (hints[f.name],) for f in dataclasses.fields(cls)}


def _is_a(value, t: type) -> bool:
    if t is bool:
        return isinstance(value, bool)
    if t in (int, float):  # True is not a count; an int is a fine float
        return not isinstance(value, bool) and isinstance(value, int if t is int else (int, float))
    return isinstance(value, t)


def check_field_types(args: EngineArgs) -> None:
    """One check for every field against its annotation, so `LLM(max_num_seqs="8")` is refused here, naming the
    field, instead of a TypeError deep in the engine. The CLI's values already have their types (argparse)."""
    for name, types in _field_types(type(args)).items():
        value = getattr(args, name)
        if not any(_is_a(value, t) for t in types):
            expected = " or ".join("None" if t is type(None) else t.__qualname__ if t.__module__ == "builtins"
                                   else f"{t.__module__}.{t.__qualname__}" for t in types)
            raise ValueError(f"engine argument {name}={_SHORT.repr(value)} ({type(value).__name__}) is invalid: "
                             f"expected {expected}")


class AsyncEngineArgs(EngineArgs):
    """Upstream's arguments for AsyncLLMEngine: the same engine arguments."""
