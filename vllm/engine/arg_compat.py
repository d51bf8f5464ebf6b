"""Upstream vLLM's engine arguments that this engine has no field for, so that users' command lines and
`LLM(...)` calls carry over: each one is accepted where its value changes nothing here, accepted with a logged
warning where it asks for something this engine does differently without changing outputs, and refused at
start-up, naming it, where honouring it silently would give the user something other than what was asked.
Never argparse's "unrecognized arguments"."""
from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm.config.utils import parse_json

logger = logging.getLogger(__name__)

IGNORED, UNSUPPORTED = "ignored", "unsupported"


@dataclass(frozen=True, slots=True)
class UpstreamArg:
    name: str  # the EngineArgs / LLM keyword
    kind: str  # IGNORED: a warning when set; UNSUPPORTED: an error when set
    reason: str
    flags: tuple[str, ...] = ()  # extra CLI spellings besides --name-with-dashes
    parse: Callable[[str], Any] | None = str  # the CLI value's type; None: a boolean flag
    # Values that are exactly what this engine does anyway: accepted without a word.
    fine: Callable[[Any], bool] = lambda v: v is None or v is False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check(self, value: Any) -> None:
        if self.fine(value):
            return
        if self.kind == UNSUPPORTED:
            raise ValueError(f"{self.flag}={value!r} is not supported by this engine: {self.reason}")
        logger.warning("%s=%r is accepted but changes nothing here: %s", self.flag, value, self.reason)


def _one(v: Any) -> bool:
    return v in (None, 1)


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or v in values


def json_value(text: str) -> Any:
    """argparse type of a JSON-valued flag: bad JSON, nesting too deep included, is argparse's one-line error
    naming the flag, not a traceback."""
    try:
        return parse_json(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None


def json_text(text: str) -> str:
    """json_value's check, keeping the text (our flags' engine arguments take JSON text or a dict)."""
    json_value(text)
    return text


_ONE_DEVICE = "split a model over GPUs with --tensor-parallel-size"
ENGINE_ARGS = {a.name: a for a in [
    UpstreamArg("pipeline_parallel_size", UNSUPPORTED, "pipeline parallelism is not built; " + _ONE_DEVICE,
                ("-pp",), int, _one),
    UpstreamArg("data_parallel_size", UNSUPPORTED, "data parallelism is not built; run one server per GPU",
                ("-dp",), int, _one),
    UpstreamArg("distributed_executor_backend", IGNORED, "ranks always run as local processes (mp)", (), str,
                _is("mp")),
    UpstreamArg("enable_chunked_prefill", IGNORED, "chunked prefill is always on (--max-num-batched-tokens sets "
                "the chunk)", (), None, _is(True)),
    UpstreamArg("max_logprobs", IGNORED, "the limit is fixed at 20 logprobs per token", (), int, _is(20)),
    UpstreamArg("disable_log_stats", IGNORED, "this engine logs no periodic stats; /metrics has them", (), None),
    UpstreamArg("kv_cache_dtype", UNSUPPORTED, "the latent cache is kept in the model's dtype (auto)", (), str,
                _is("auto")),
    UpstreamArg("swap_space", IGNORED, "preempted requests are recomputed, never swapped to the CPU", (), float,
                lambda v: True),
    UpstreamArg("cpu_offload_gb", UNSUPPORTED, "weights stay on the device", (), float, _is(0, 0.0)),
    UpstreamArg("quantization", UNSUPPORTED, "quantized checkpoints are not supported", ("-q",), str),
    UpstreamArg("revision", UNSUPPORTED, "models load from local directories only", (), str),
    UpstreamArg("code_revision", UNSUPPORTED, "models load from local directories only", (), str),
    UpstreamArg("tokenizer_revision", UNSUPPORTED, "tokenizers load from local directories only", (), str),
    UpstreamArg("download_dir", IGNORED, "models load from local directories only", (), str),
    UpstreamArg("tokenizer_mode", UNSUPPORTED, "the tokenizer loads through transformers' AutoTokenizer", (), str,
                _is("auto", "hf", "slow")),
    UpstreamArg("skip_tokenizer_init", UNSUPPORTED, "the engine detokenizes and needs its tokenizer", (), None),
    UpstreamArg("max_seq_len_to_capture", IGNORED, "graphs cover decode batches of any context length", (), int,
                lambda v: True),
    UpstreamArg("disable_custom_all_reduce", IGNORED, "there is no all-reduce on one device", (), None),
    UpstreamArg("enable_lora", UNSUPPORTED, "LoRA adapters are not supported", (), None),
    UpstreamArg("max_loras", IGNORED, "LoRA adapters are not supported", (), int, lambda v: True),
    UpstreamArg("max_lora_rank", IGNORED, "LoRA adapters are not supported", (), int, lambda v: True),
    UpstreamArg("scheduling_policy", UNSUPPORTED, "requests are scheduled first come, first served", (), str,
                _is("fcfs")),
    UpstreamArg("enable_sleep_mode", UNSUPPORTED, "sleep mode is not supported", (), None),
    UpstreamArg("enable_prompt_embeds", UNSUPPORTED, "prompts are token ids or text", (), None),
    UpstreamArg("hf_overrides", UNSUPPORTED, "config.json is read as saved", (), json_value,
                lambda v: v in (None, {})),
    UpstreamArg("disable_sliding_window", IGNORED, "the model has no sliding window", (), None),
    UpstreamArg("disable_cascade_attn", IGNORED, "cascade attention is not used", (), None),
    UpstreamArg("calculate_kv_scales", IGNORED, "the cache is not quantized", (), None),
    UpstreamArg("max_parallel_loading_workers", IGNORED, "checkpoints load in one process", (), int),
    UpstreamArg("model_impl", UNSUPPORTED, "the model is this engine's own implementation", (), str,
                _is("auto", "vllm")),
    UpstreamArg("task", UNSUPPORTED, "this engine only generates text", (), str, _is("auto", "generate")),
    UpstreamArg("runner", UNSUPPORTED, "this engine only generates text", (), str, _is("auto", "generate")),
    UpstreamArg("logprobs_mode", UNSUPPORTED, "logprobs are the model's raw log-softmax (raw_logprobs)", (), str,
                _is("raw_logprobs")),
    UpstreamArg("disable_async_output_proc", IGNORED, "outputs are processed as --async-scheduling says", (), None),
    UpstreamArg("limit_mm_per_prompt", IGNORED, "the model is text-only", (), json_value),
    UpstreamArg("mm_processor_kwargs", IGNORED, "the model is text-only", (), json_value),
    UpstreamArg("kv_transfer_config", UNSUPPORTED, "disaggregated prefill is not supported", (), json_value),
    UpstreamArg("otlp_traces_endpoint", IGNORED, "tracing is not built", (), str),
    UpstreamArg("guided_decoding_backend", IGNORED, "guided decoding is not supported", (), str),
    UpstreamArg("worker_cls", UNSUPPORTED, "the worker is this engine's own", (), str, _is("auto")),
]}


def add_upstream_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                      args: dict[str, UpstreamArg]) -> None:
    """Each flag parses to its own dest, default None (not given)."""
    for a in args.values():
        if a.parse is None:
            parser.add_argument(a.flag, *a.flags, dest=a.name, action=argparse.BooleanOptionalAction, default=None,
                                help=argparse.SUPPRESS)
        else:
            parser.add_argument(a.flag, *a.flags, dest=a.name, type=a.parse, default=None, help=argparse.SUPPRESS)


def check_upstream_args(values: dict[str, Any], args: dict[str, UpstreamArg] = ENGINE_ARGS) -> None:
    """Warns about or refuses each given upstream argument (see the module docstring)."""
    for name, value in values.items():
        args[name].check(value)
