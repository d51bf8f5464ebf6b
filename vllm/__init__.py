"""A vLLM-compatible inference engine specialised for the Kimi-K3 / Kimi-Linear model family."""
from vllm.version import __version__

__all__ = ["__version__"]
