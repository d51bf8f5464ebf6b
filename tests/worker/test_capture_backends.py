"""The runner's real capture path through every decode and MLA backend the selector knows, on a CPU.

`LLM(...)` sizes the pools and captures its decode graphs exactly as on a GPU (`StepGraphs.capture`
over `InputBatch.fill_for_capture`), with the CPU stand-in for capture that refuses host syncs
(tests/graph_standin.py). Kernels the CPU cannot run are stubs bound to their library's real signature that check
shapes, dtypes and layouts (tests/flashinfer_stubs.py); native KDA decode and TRITON_MLA run in Triton's
interpreter. Before capture every request-owned state slot holds NaN (slot 0, the null slot, zeros) and the latent
cache random values: the capture dummies sit on the null slot with no cache rows, so afterwards every slot a
request could own and every cache row must be exactly as it was, and the captured step's output finite (no dummy
read a request's state). Backends that cannot be captured must leave the engine eager.
"""
from __future__ import annotations

import importlib.util

import flashinfer_stubs
import pytest
import torch
from graph_standin import ReplayByRerun

from vllm import LLM
from vllm.assets import TINY_TOKENIZER_DIR
from vllm.attention import selector
from vllm.config import CompilationConfig
from vllm.core.kv_cache_manager import NULL_STATE_SLOT
from vllm.tools.make_tiny_model import tiny_text_config, write_tiny_model
from vllm.worker import graphs
from vllm.worker.cudagraph import CUDAGraphMode
from vllm.worker.decode_tail import DecodeTail

MLA = list(selector.BACKENDS["--attention-backend"])
KDA_DECODE = list(selector.BACKENDS["--kda-decode-backend"])
NEEDS = {"FLASHINFER_MLA": ("flashinfer", "triton"), "TRITON_MLA": ("triton",), "flashinfer": ("flashinfer",),
         "native": ("triton",), "triton": ("fla", "triton")}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Tiny K3 checkpoints by (FlashInfer KDA shapes, FlashInfer MLA shapes): 12 KDA heads of 128 where FlashInfer
    decodes, MLA kv_lora_rank 512 and rope 64 where FlashInfer runs MLA, small shapes elsewhere (the interpreter
    runs native decode and TRITON_MLA slowly at real shapes)."""
    made = {}

    def get(fi_kda: bool, fi_mla: bool) -> str:
        if (fi_kda, fi_mla) not in made:
            lac = dict(tiny_text_config("k3")["linear_attn_config"], head_dim=128 if fi_kda else 32,
                       num_heads=12 if fi_kda else 2)
            mla = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128) if fi_mla \
                else dict(qk_rope_head_dim=16)
            made[fi_kda, fi_mla] = write_tiny_model(tmp_path_factory.mktemp("k3"), "k3", linear_attn_config=lac,
                                                    num_attention_heads=2, **mla)
        return made[fi_kda, fi_mla]
    return get


def _pools(runner):
    """(is a state pool, the pool) for every layer: KDA conv and recurrent state slots, MLA latent caches."""
    for layer in runner.model.model.layers:
        attn = layer.self_attn
        yield from (((True, attn.conv_state), (True, attn.ssm_state)) if layer.is_kda else ((False, attn.kv_cache),))


def _owned(is_state: bool, pool: torch.Tensor) -> torch.Tensor:
    """What requests can own: every state slot but the null slot, every cache row."""
    return pool[NULL_STATE_SLOT + 1:] if is_state else pool


def _fill_then_capture(monkeypatch, seen: dict):
    """Wraps the real capture: sentinel pools before it, and what they and the captured outputs hold after."""
    capture = graphs.StepGraphs.capture

    def wrapped(step_graphs, reserved_bytes):
        runner = step_graphs  # _pools reads the model, which it holds
        gen = torch.Generator().manual_seed(0)
        for is_state, pool in _pools(runner):
            if is_state:
                pool.fill_(float("nan"))
                pool[NULL_STATE_SLOT] = 0
            else:
                pool.copy_(torch.randn(pool.shape, generator=gen))
        before = [_owned(*p).clone() for p in _pools(runner)]
        capture(step_graphs, reserved_bytes)
        seen["before"], seen["after"] = before, [_owned(*p).clone() for p in _pools(runner)]
        captured = step_graphs.captured
        seen["outputs"] = {d: captured.replay(d) for d in captured.fns} if captured else {}
    monkeypatch.setattr(graphs.StepGraphs, "capture", wrapped)


@pytest.mark.parametrize("decode", KDA_DECODE)
@pytest.mark.parametrize("mla", MLA)
def test_capture_dummies_touch_no_request_state(model_dirs, monkeypatch, mla, decode):
    for lib in (*NEEDS.get(mla, ()), *NEEDS.get(decode, ())):
        if importlib.util.find_spec(lib) is None:
            pytest.skip(f"{lib} is not installed")
    if torch.cuda.is_available():
        pytest.skip("the stand-in capture is the CPU path; GPU runs capture for real (test_graph_replay.py)")
    libs = {lib for name in (mla, decode) for lib in NEEDS.get(name, ()) if lib != "triton"}
    log = flashinfer_stubs.install(monkeypatch, tuple(libs))
    for flag, name in (("--attention-backend", mla), ("--kda-decode-backend", decode)):
        monkeypatch.setattr(selector.load_backend(flag, name), "supports", classmethod(lambda cls, *a, **k: None))
    monkeypatch.setattr(CompilationConfig, "resolved_mode",
                        lambda self, device: "NONE" if self.enforce_eager else (self.cudagraph_mode or "NONE"))
    monkeypatch.setattr(graphs, "CUDAGraphRunner", ReplayByRerun)
    seen = {}
    _fill_then_capture(monkeypatch, seen)
    llm = LLM(model=model_dirs(decode == "flashinfer", mla == "FLASHINFER_MLA"), tokenizer=str(TINY_TOKENIZER_DIR),
              dtype="bfloat16", max_model_len=64, block_size=32,
              max_num_seqs=4, max_num_batched_tokens=16, kv_cache_memory_bytes=48 << 20,
              attention_backend=mla, kda_prefill_backend="torch", kda_decode_backend=decode,
              compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [2, 4]})
    runner = llm.llm_engine.runner
    capturable = runner.mla_builder.cudagraph_support > 0 and runner.kda_builder.cudagraph_support > 0
    if not capturable:  # the torch references: lowered to eager with the reason logged, nothing captured
        assert runner.cudagraph_mode is CUDAGraphMode.NONE and runner.graphs.captured is None
        return
    assert runner.cudagraph_mode is CUDAGraphMode.FULL_DECODE_ONLY and len(seen["outputs"]) == 2
    stubbed = {"flashinfer": "fused_kda_decode", "triton": "fused_recurrent_kda_fwd",
               "FLASHINFER_MLA": "trtllm_batch_decode_with_kv_cache_mla"}
    for name in (stubbed.get(mla), stubbed.get(decode)):
        assert name is None or log[name], f"the capture did not reach the {name} stub"
    for before, after in zip(seen["before"], seen["after"]):
        assert torch.equal(before.isnan(), after.isnan()) and torch.equal(before.nan_to_num(), after.nan_to_num()), \
            "a capture dummy wrote into state or cache a request could own"
    for desc, out in seen["outputs"].items():
        hidden = out.hidden if isinstance(out, DecodeTail) else out  # decode graphs end in the decode tail
        assert torch.isfinite(hidden.float()).all(), f"the {desc} dummies read a request's (NaN) state"
