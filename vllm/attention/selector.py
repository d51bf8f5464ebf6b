"""Picks the attention backends from the engine args.

`auto` takes the first backend in a fastest-first order that runs on the device for this model; an explicit
choice that cannot run fails at start-up naming the backend, what it needs and what is here — never a silent
fallback. A backend's `supports()` accepts only the architectures it is meant for and has run on, so on sm90
`auto` takes TRITON_MLA, native decode and FlashKDA (else fla) prefill even with flashinfer installed, and
FlashInfer comes first only on sm100/sm103 (docs/backends.md). Backend modules are imported only when asked
about, so optional kernel packages (triton, fla-core, flashinfer, flash_kda) stay optional.
"""
from __future__ import annotations

import importlib

import torch

from vllm.attention.backend import AttentionBackend, HybridBackends, LayerShapes
from vllm.attention.kda.metadata import KDAAttention
from vllm.attention.kda.torch_ref import TorchKDABackend
from vllm.attention.mla.torch_ref import TorchMLABackend
from vllm.config import KernelConfig

# flag -> {choice: "module:Class"}, fastest first: `auto` walks this order.
BACKENDS: dict[str, dict[str, str]] = {
    "--attention-backend": {
        "FLASHINFER_MLA": "vllm.attention.mla.flashinfer_mla:FlashInferMLABackend",
        "TRITON_MLA": "vllm.attention.mla.triton_mla:TritonMLABackend",
        "TORCH_MLA": "vllm.attention.mla.torch_ref:TorchMLABackend",
    },
    "--kda-prefill-backend": {
        "flashinfer": "vllm.attention.kda.flashinfer:FlashInferKDABackend",
        "flashkda": "vllm.attention.kda.flashkda:FlashKDABackend",
        "triton": "vllm.attention.kda.triton_fla:TritonFLAKDABackend",
        "torch": "vllm.attention.kda.torch_ref:TorchKDABackend",
    },
    "--kda-decode-backend": {
        "flashinfer": "vllm.attention.kda.flashinfer:FlashInferKDABackend",
        "native": "vllm.attention.kda.native:NativeKDABackend",
        "triton": "vllm.attention.kda.triton_fla:TritonFLAKDABackend",
        "torch": "vllm.attention.kda.torch_ref:TorchKDABackend",
    },
}


def load_backend(flag: str, choice: str) -> type[AttentionBackend]:
    module, _, cls = BACKENDS[flag][choice].partition(":")
    return getattr(importlib.import_module(module), cls)


def backend_reason(flag: str, choice: str, device: torch.device, dtype: torch.dtype,
                   shapes: LayerShapes | None) -> str | None:
    """Why `choice` cannot run here (None when it can)."""
    try:
        backend = load_backend(flag, choice)
    except ImportError as e:
        return f"a package it needs is not installed ({e}); the extras are listed in docs/backends.md"
    if flag == "--kda-decode-backend" and shapes is not None and shapes.recover_ssm and not backend.decode_records:
        return "it does not write RecoverSSM's per-token records, which --use-replayssm needs; use native or torch"
    if (flag == "--kda-decode-backend" and shapes is not None and shapes.num_speculative_tokens
            and not shapes.recover_ssm and not backend.decode_checkpoints):
        return ("it does not write per-token state checkpoints, which speculative decoding "
                f"(num_speculative_tokens={shapes.num_speculative_tokens}) needs; use native or torch")
    return backend.supports(device, dtype, shapes)


def _pick(flag: str, choice: str, device: torch.device, dtype: torch.dtype,
          shapes: LayerShapes | None) -> type[AttentionBackend]:
    if choice != "auto":
        reason = backend_reason(flag, choice, device, dtype, shapes)
        if reason is not None:
            raise ValueError(f"{flag}={choice} cannot run on {describe_device(device)}: {reason}")
        return load_backend(flag, choice)
    reasons = {}
    for name in BACKENDS[flag]:
        reasons[name] = backend_reason(flag, name, device, dtype, shapes)
        if reasons[name] is None:
            return load_backend(flag, name)
    raise ValueError(f"{flag}=auto: no backend runs on {describe_device(device)}: {reasons}")


def describe_device(device: torch.device) -> str:
    if device.type != "cuda":
        return str(device)
    major, minor = torch.cuda.get_device_capability(device)
    return f"{device} ({torch.cuda.get_device_name(device)}, sm{major}{minor})"


def select_backends(kernel: KernelConfig, device: torch.device, dtype: torch.dtype,
                    shapes: LayerShapes | None = None) -> HybridBackends:
    mla = _pick("--attention-backend", kernel.attention_backend, device, dtype, shapes)
    prefill = _pick("--kda-prefill-backend", kernel.kda_prefill_backend, device, dtype, shapes)
    decode = _pick("--kda-decode-backend", kernel.kda_decode_backend, device, dtype, shapes)
    return HybridBackends(kda=KDAAttention(prefill, decode), mla=mla)


def reference_backends() -> HybridBackends:
    return HybridBackends(kda=KDAAttention(TorchKDABackend, TorchKDABackend), mla=TorchMLABackend)
