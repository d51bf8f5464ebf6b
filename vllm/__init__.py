"""A vLLM-compatible inference engine specialised for the Kimi-K3 / Kimi-Linear model family."""
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.engine.async_llm import AsyncLLMEngine
from vllm.entrypoints.llm import LLM
from vllm.inputs import PromptType, TextPrompt, TokensPrompt
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from vllm.transformers_utils.configs import register_configs
from vllm.version import __version__

register_configs()

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs", "AsyncEngineArgs",
           "AsyncLLMEngine", "PromptType", "TextPrompt", "TokensPrompt", "RequestOutputKind", "BeamSearchParams",
           "__version__"]
