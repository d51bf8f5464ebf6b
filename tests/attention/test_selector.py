"""Backend selection: `auto` picks the first backend that runs, explicit choices that cannot run fail loudly."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm.attention import selector
from vllm.attention.backend import LayerShapes
from vllm.attention.selector import select_backends
from vllm.config import KernelConfig

K3_SHAPES = LayerShapes(kda_num_heads=12, kda_head_dim=128, kda_gate_bounded=True, mla_num_heads=16,
                        kv_lora_rank=512, qk_rope_head_dim=64, block_size=64)


def test_auto_on_cpu_picks_the_torch_references():
    b = select_backends(KernelConfig(), torch.device("cpu"), torch.float32, K3_SHAPES)
    assert (b.mla.name, b.kda.prefill.name, b.kda.decode.name) == ("TORCH_MLA", "torch", "torch")


@pytest.mark.parametrize("flag,field,choice", [
    ("--attention-backend", "attention_backend", "TRITON_MLA"),
    ("--attention-backend", "attention_backend", "FLASHINFER_MLA"),
    ("--kda-decode-backend", "kda_decode_backend", "native"),
    ("--kda-decode-backend", "kda_decode_backend", "triton"),
    ("--kda-decode-backend", "kda_decode_backend", "flashinfer"),
    ("--kda-prefill-backend", "kda_prefill_backend", "triton"),
    ("--kda-prefill-backend", "kda_prefill_backend", "flashkda"),
    ("--kda-prefill-backend", "kda_prefill_backend", "flashinfer"),
])
def test_explicit_choice_the_cpu_cannot_run_fails_with_the_reason(flag, field, choice):
    with pytest.raises(ValueError) as e:
        select_backends(KernelConfig(**{field: choice}), torch.device("cpu"), torch.float32, K3_SHAPES)
    msg = str(e.value)
    assert msg.startswith(f"{flag}={choice} cannot run on cpu: ")
    reason = msg.split(": ", 1)[1]
    assert any(word in reason for word in ("CUDA", "GPU", "not installed", "pip install")), reason


class _Runs:
    name = "RUNS"
    runs_prefill = runs_decode = True

    @classmethod
    def supports(cls, device, dtype, shapes=None):
        return None


class _Refuses(_Runs):
    name = "REFUSES"

    @classmethod
    def supports(cls, device, dtype, shapes=None):
        return "needs sm100 (device is sm90)"


def test_auto_walks_the_fastest_first_order(monkeypatch):
    classes = {"fast": _Refuses, "middle": _Runs, "slow": _Runs}
    monkeypatch.setitem(selector.BACKENDS, "--attention-backend", {n: n for n in classes})
    monkeypatch.setattr(selector, "load_backend", lambda flag, choice: classes[choice])
    assert selector._pick("--attention-backend", "auto", torch.device("cpu"), torch.float32, None) is _Runs
    with pytest.raises(ValueError, match=r"--attention-backend=fast cannot run on cpu: needs sm100 \(device is sm90\)"):
        selector._pick("--attention-backend", "fast", torch.device("cpu"), torch.float32, None)
    classes["middle"] = classes["slow"] = _Refuses
    with pytest.raises(ValueError, match="--attention-backend=auto: no backend runs on cpu"):
        selector._pick("--attention-backend", "auto", torch.device("cpu"), torch.float32, None)


def test_a_missing_optional_package_is_a_reason_not_a_crash(monkeypatch):
    def fail(flag, choice):
        raise ImportError("No module named 'flashinfer'")
    monkeypatch.setattr(selector, "load_backend", fail)
    reason = selector.backend_reason("--attention-backend", "FLASHINFER_MLA", torch.device("cpu"), torch.float32, None)
    assert "flashinfer" in reason and "not installed" in reason



HOPPER, BLACKWELL = (9, 0), (10, 0)


@pytest.fixture
def gpu_at(monkeypatch):
    """A CUDA device of a chosen compute capability with every optional kernel package importable (flashinfer and
    fla-core are test dependencies; flash_kda a stub with its real signature): what `auto` sees on a full install."""
    for lib in ("flashinfer", "fla", "triton"):
        pytest.importorskip(lib)
    import flashinfer_stubs
    flashinfer_stubs.install(monkeypatch, ("flash_kda",))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")

    def at(capability):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        return torch.device("cuda")
    return at


@pytest.mark.parametrize("capability,shapes,want", [
    (HOPPER, K3_SHAPES, ("TRITON_MLA", "flashkda", "native")),
    (HOPPER, dataclasses.replace(K3_SHAPES, kda_gate_bounded=False), ("TRITON_MLA", "triton", "native")),
    (BLACKWELL, K3_SHAPES, ("FLASHINFER_MLA", "flashinfer", "flashinfer")),
    # FlashInfer's decode writes no checkpoint columns, which speculative decoding needs.
    (BLACKWELL, dataclasses.replace(K3_SHAPES, num_speculative_tokens=3), ("FLASHINFER_MLA", "flashinfer", "native")),
], ids=["sm90", "sm90_softplus_gate", "sm100", "sm100_speculative"])
def test_auto_picks_only_what_runs_on_the_architecture(gpu_at, capability, shapes, want):
    """On sm90, FlashInfer installed or not: TRITON_MLA, native decode, FlashKDA prefill where its constraints hold
    (else fla's triton); FlashInfer first only on sm100/sm103."""
    b = select_backends(KernelConfig(), gpu_at(capability), torch.bfloat16, shapes)
    assert (b.mla.name, b.kda.prefill.name, b.kda.decode.name) == want


def test_flashinfer_mla_chosen_on_hopper_fails_at_start_up(gpu_at):
    with pytest.raises(ValueError) as e:
        select_backends(KernelConfig(attention_backend="FLASHINFER_MLA"), gpu_at(HOPPER), torch.bfloat16, K3_SHAPES)
    msg = str(e.value)
    assert msg.startswith("--attention-backend=FLASHINFER_MLA cannot run on cuda (Test GPU, sm90): ")
    assert "sm100/sm103" in msg and "TRITON_MLA" in msg
