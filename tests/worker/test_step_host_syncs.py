"""A served decode or verify step queues all its device work without waiting for the device: the host's only wait
is for the step's own outputs (an event). Any other synchronizing call (a pageable copy, .item(), nonzero) makes
the host sit out the forward and then pay for the rest of the step on top of it. torch's sync debug mode sees
those calls; CUDA only."""
from __future__ import annotations

import sys
import warnings

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.assets import TINY_TOKENIZER_DIR
from vllm.tools.make_dspark_draft import write_dspark_draft


def _vllm_sync_sites(run) -> list[str]:
    """The innermost vllm frame of each synchronizing call `run` makes."""
    sites = []

    def record(message, category, filename, lineno, file=None, line=None):
        f = sys._getframe(1)
        while f is not None and "/vllm/" not in f.f_code.co_filename:
            f = f.f_back
        if f is not None:
            sites.append(f"{f.f_code.co_filename.split('/vllm/')[-1]}:{f.f_lineno} {f.f_code.co_name}")

    with warnings.catch_warnings():  # restores the filters and showwarning after
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites


@pytest.mark.gpu
@pytest.mark.parametrize("adaptive", [False, True], ids=["dspark", "adaptive"])
def test_verify_steps_do_not_wait_for_the_device(model_dir, tmp_path, adaptive, monkeypatch):
    """With adaptive verification every all-verify step is re-cut to half its drafts (the budget's choice
    replaced), so the trim path (the device split, InputBatch.trim_on_device) is checked too: left to its costs
    a host-bound step keeps every draft and never trims, and a stale measurement of the untrimmed step keeps them
    too."""
    from vllm.spec_decode import adaptive_verification as adaptive_module
    monkeypatch.setattr(adaptive_module.verifier, "choose_budget", lambda survivals, *a, **kw: len(survivals) // 2)
    monkeypatch.setattr(adaptive_module.StepTimes, "stale", lambda self, *a: False)  # no untrimmed re-measures
    draft = write_dspark_draft(tmp_path / "draft", target_dir=model_dir, seed=5)
    spec = {"method": "dspark", "model": draft, "num_speculative_tokens": 3,
            "enable_adaptive_verification": adaptive}
    llm = LLM(model=model_dir, tokenizer=str(TINY_TOKENIZER_DIR), dtype="float32", max_model_len=128, max_num_seqs=4,
              speculative_config=spec,
              compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"})
    engine = llm.llm_engine
    trims = []
    if adaptive:
        verifier = engine.runner.device_trim_hook
        verifier.times.overlapped = False  # every all-verify step asks choose_budget

        def counted(out, common):
            trim = verifier(out, common)
            trims.append(trim is not None)
            return trim
        engine.runner.device_trim_hook = counted
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (9, 14)]
    llm.generate(prompts, params, use_tqdm=False)  # first-use allocations outside the count
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    engine.step()  # the prefill: its chunk bookkeeping may wait, only decode/verify steps are checked

    def decode():
        while engine.has_unfinished_requests():
            engine.step()

    assert _vllm_sync_sites(decode) == []
    assert engine.spec_decode_stats.num_draft_tokens > 0
    assert any(trims) or not adaptive


@pytest.mark.gpu
def test_mixed_steps_do_not_wait_for_the_device(model_dir):
    """A prompt that arrives while others decode runs in a mixed step, whose KDA groups and MLA chunks are
    gathered on the host: their indices go up in queued copies (a plain .to(device) waited for the step before:
    8 syncs per mixed step), so the host still runs ahead of the device. A prompt chunk past the recurrent
    kernel's length takes fla's chunk_kda, whose chunk bookkeeping copies once per step (fla's own blocking
    copy) and is reused by every later KDA layer (4 here), not redone per layer."""
    llm = LLM(model=model_dir, tokenizer=str(TINY_TOKENIZER_DIR), dtype="float32", max_model_len=512,
              max_num_seqs=8)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def batch(offset):  # no two prompts share a first token: no prefix cache hit shortens the checked chunks
        return [{"prompt_token_ids": [5 + (offset + 11 * r + i) % 200 for i in range(n)]}
                for r, n in enumerate((9, 14, 40, 33, 300))]
    llm.generate(batch(7), params, use_tqdm=False)  # first-use allocations outside the count
    prompts = batch(0)
    for i, p in enumerate(prompts[:2]):
        engine.add_request(f"d{i}", p, params)
    engine.step()
    engine.step()  # both decode now

    def mixed(new):
        def run():
            for i, p in enumerate(new):
                engine.add_request(f"p{len(p['prompt_token_ids'])}-{i}", p, params)
            engine.step()
        return run

    # two prompt chunks of over 16 tokens (MLA's varlen path) beside two decode rows
    assert _vllm_sync_sites(mixed(prompts[2:4])) == []
    long_chunk = _vllm_sync_sites(mixed(prompts[4:]))
    assert len(long_chunk) <= 1 and all("triton_fla.py" in site for site in long_chunk), long_chunk
    while engine.has_unfinished_requests():
        engine.step()
