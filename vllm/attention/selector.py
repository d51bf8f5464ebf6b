"""Picks the attention backends from the engine args.

`auto` takes the fastest backend that runs on the device; an explicit choice that cannot run fails at
start-up naming the backend, what it needs and what is here. Only the torch references are built so far.
"""
from __future__ import annotations

import torch

from vllm.attention.backend import HybridBackends
from vllm.attention.kda.torch_ref import TorchKDABackend
from vllm.attention.mla.torch_ref import TorchMLABackend
from vllm.config import KernelConfig

_BUILT = {"--attention-backend": {"TORCH_MLA": TorchMLABackend},
          "--kda-prefill-backend": {"torch": TorchKDABackend},
          "--kda-decode-backend": {"torch": TorchKDABackend}}
_AUTO = {"--attention-backend": "TORCH_MLA", "--kda-prefill-backend": "torch", "--kda-decode-backend": "torch"}


def _pick(flag: str, choice: str, device: torch.device, dtype: torch.dtype):
    name = _AUTO[flag] if choice == "auto" else choice
    backend = _BUILT[flag].get(name)
    if backend is None:
        raise ValueError(f"{flag}={choice} is not available in this build yet; available: auto, "
                         f"{', '.join(_BUILT[flag])}")
    reason = backend.supports(device, dtype)
    if reason is not None:
        raise ValueError(f"{flag}={choice} cannot run on {device}: {reason}")
    return backend


def select_backends(kernel: KernelConfig, device: torch.device, dtype: torch.dtype) -> HybridBackends:
    mla = _pick("--attention-backend", kernel.attention_backend, device, dtype)
    prefill = _pick("--kda-prefill-backend", kernel.kda_prefill_backend, device, dtype)
    decode = _pick("--kda-decode-backend", kernel.kda_decode_backend, device, dtype)
    assert prefill is decode, "split KDA prefill/decode backends arrive with the kernel backends"
    return HybridBackends(kda=decode, mla=mla)


def reference_backends() -> HybridBackends:
    return HybridBackends(kda=TorchKDABackend, mla=TorchMLABackend)
