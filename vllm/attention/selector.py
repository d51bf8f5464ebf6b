"""Picks the attention backends a model runs with.

Only the torch reference backends exist so far; the engine args that choose faster ones
(--attention-backend, --kda-prefill-backend, --kda-decode-backend) are resolved here.
"""
from vllm.attention.backend import HybridBackends
from vllm.attention.kda.torch_ref import TorchKDABackend
from vllm.attention.mla.torch_ref import TorchMLABackend


def reference_backends() -> HybridBackends:
    return HybridBackends(kda=TorchKDABackend, mla=TorchMLABackend)
