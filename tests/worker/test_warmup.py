"""The start-up warm-up: its steps cross every host-side kernel choice within the scheduler's bounds, and
running them leaves every cache and state slot that requests use untouched, so outputs do not change."""
from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.attention.kda.native import BLOCK_V, programs_per_head
from vllm.core.kv_cache_manager import NULL_STATE_SLOT
from vllm.worker.cache_sizing import last_chunk_forward
from vllm.worker.warmup import eager_warmup_steps

SHORT, RECURRENT = 16, 256


@pytest.mark.parametrize("seqs,budget,model_len", [(64, 8192, 392), (256, 8192, 32768), (8, 32, 256), (1, 64, 64)])
def test_steps_fit_the_bounds(seqs, budget, model_len):
    steps = eager_warmup_steps(seqs, budget, model_len, SHORT, RECURRENT)
    assert steps and len(set(steps)) == len(steps)
    for step in steps:
        assert len(step.query_lens) <= seqs and 1 <= min(step.query_lens) and step.num_tokens <= budget
        assert all(q + c <= model_len for q, c in zip(step.query_lens, step.context_lens))
        assert all(q == 1 for q, p in zip(step.query_lens, step.prefilling) if not p), "decode rows are 1 token"


def test_steps_cross_each_kernel_choice():
    """At the served benchmark's bounds: every absorbed tile family beside decode rows with several MLA splits,
    unabsorbed chunks beside them, a step of short chunks only (fla's recurrent kernel) and chunk_kda steps."""
    steps = eager_warmup_steps(64, 8192, 392, SHORT, RECURRENT)

    def prompts(step, longer_than=0):
        return [q for q, p in zip(step.query_lens, step.prefilling) if p and q > longer_than]
    with_decode = [s for s in steps if not all(s.prefilling)]
    assert all(max(s.context_lens) > 256 for s in with_decode), "decode rows over a context: several splits"
    for short in (1, 2, 3, SHORT):  # absorbed prompt rows, alone and beside an unabsorbed chunk
        assert any(short in prompts(s) and not prompts(s, SHORT) for s in with_decode)
        assert any(short in prompts(s) and prompts(s, SHORT) for s in with_decode)
    assert any(len(prompts(s)) > 1 and max(prompts(s)) <= RECURRENT and all(s.prefilling) for s in steps)
    assert any(max(prompts(s), default=0) > RECURRENT and not all(s.prefilling) for s in steps)
    assert any(max(prompts(s), default=0) > RECURRENT and max(s.context_lens) > 0 for s in steps)
    assert any(not any(s.prefilling) for s in steps), "an eager decode step"
    # Native KDA decode splits a head over 4, 2 or 1 programs by decode rows x heads against the SM count:
    # whatever the head count, the eager decode steps meet every split a batch of 1..32 rows gets.
    sizes = {len(s.query_lens) for s in steps if not any(s.prefilling)}
    for heads in (1, 12, 16, 32, 96, 200):
        def split(n):
            return programs_per_head(n, heads, 128, BLOCK_V, 132)
        assert {split(n) for n in range(1, 33)} == {split(n) for n in sizes}


def _caches(llm):
    """(latent cache, conv state, ssm state) of every layer, None where the layer has none."""
    return [(None, layer.self_attn.conv_state, layer.self_attn.ssm_state) if layer.is_kda
            else (layer.self_attn.kv_cache, None, None) for layer in llm.llm_engine.runner.model.model.layers]


def test_warm_up_and_the_profiles_last_chunk_touch_no_request_state():
    # No prefix caching: the pools are overwritten below, cached prefixes included, and the prompts run again.
    llm = LLM(max_model_len=256, dtype="float32", max_num_batched_tokens=64, max_num_seqs=8,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[5 + i] * (9 + 7 * i) for i in range(4)]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    # The finished requests' blocks and slots hold their contents (freed, not cleared): random values to keep.
    for pools in _caches(llm):
        for pool in pools:
            if pool is not None:
                pool.copy_(torch.randn(pool.shape, generator=torch.Generator().manual_seed(0)).to(pool.dtype))
    kept = [[None if p is None else p.clone() for p in pools] for pools in _caches(llm)]
    free = llm.llm_engine.kv_cache_manager.block_pool.num_free
    runner = llm.llm_engine.runner
    runner.warm_up_eager_steps()
    # The memory profile's last chunk of a max_model_len prompt (cache_sizing.py) runs on the same harmless inputs.
    hidden = last_chunk_forward(runner.model, runner.input_batch, runner._attn_metadata, 64, 256 - 64)
    assert hidden.shape[0] == 64 and torch.isfinite(hidden).all()
    for old, new in zip(kept, _caches(llm)):
        kv, conv, ssm = new
        if kv is not None:
            assert torch.equal(old[0], kv), "the warm-up wrote the latent cache"
        for was, now in ((old[1], conv), (old[2], ssm)):
            if now is not None:
                others = [s for s in range(now.shape[0]) if s != NULL_STATE_SLOT]
                assert torch.equal(was[others], now[others]), "the warm-up wrote a request's state slot"
    assert llm.llm_engine.kv_cache_manager.block_pool.num_free == free
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == before


def test_backends_declare_the_lengths_where_they_switch_kernels():
    """The warm-up reads the switch lengths the backends declare (no guessed attributes); a backend without a
    switch declares None and the steps keep their default shapes."""
    from vllm.attention.kda.native import NativeKDABackend
    from vllm.attention.kda.triton_fla import TritonFLAKDABackend
    from vllm.attention.mla.torch_ref import TorchMLABackend
    from vllm.attention.mla.triton_mla import PREFILL_MIN_QUERY_LEN, TritonMLABackend
    assert TritonMLABackend.builder(16).prefill_min_query_len == PREFILL_MIN_QUERY_LEN
    assert TorchMLABackend.builder(16).prefill_min_query_len is None
    assert TritonFLAKDABackend.recurrent_prefill_max_len == RECURRENT
    assert NativeKDABackend.recurrent_prefill_max_len is None
    assert eager_warmup_steps(64, 8192, 392, None, None) == eager_warmup_steps(64, 8192, 392, SHORT, RECURRENT)
    assert eager_warmup_steps(64, 8192, 392, 8, 128) != eager_warmup_steps(64, 8192, 392, None, None)
