"""The step after the forward takes ONE logits pass over the rows that need logits (verify tokens, sampling rows,
prompt-logprob positions) and each consumer reads its slice. A step mixing all three kinds gives every request
what it gets alone, and compute_logits runs once per step."""
from __future__ import annotations

import pytest
import torch
from code_prompts import CODE_PROMPTS

from vllm import LLM, SamplingParams


def _llm(**kwargs) -> LLM:
    return LLM(dtype="float32", max_model_len=256, max_num_batched_tokens=40, **kwargs)


def test_verify_sample_and_prompt_logprob_rows_share_one_logits_pass():
    code = [{"prompt": p} for p in CODE_PROMPTS[:2]]
    gen = torch.Generator().manual_seed(3)
    scored = {"prompt_token_ids": torch.randint(5, 250, (60,), generator=gen).tolist()}
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    logprobs = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    plain = _llm()
    want = [plain.generate([p], s, use_tqdm=False)[0] for p, s in ((code[0], greedy), (code[1], greedy),
                                                                    (scored, logprobs))]
    llm = _llm(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    runner = llm.llm_engine.runner
    calls, steps = [], []
    compute_logits = runner.sample_step.compute_logits
    runner.sample_step.compute_logits = lambda h: calls.append(h.shape[0]) or compute_logits(h)
    execute = runner.execute_model

    def spy(out, *args, **kwargs):
        kinds = {"verify" if s.draft_token_ids else "sample" if s.samples else "chunk" for s in out.scheduled}
        steps.append((kinds, len(calls)))
        return execute(out, *args, **kwargs)
    runner.execute_model = spy
    got = llm.generate([code[0], code[1], scored], [greedy, greedy, logprobs], use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    # The same tokens; the logprobs within float32 noise (a row's logits come from a batch of another size).
    for g, w in zip(got[2].prompt_logprobs, want[2].prompt_logprobs):
        assert list((g or {}).keys()) == list((w or {}).keys())
        assert [lp.logprob for lp in (g or {}).values()] == \
            pytest.approx([lp.logprob for lp in (w or {}).values()], abs=1e-3)
    assert got[2].outputs[0].logprobs is not None and len(got[2].outputs[0].logprobs) == 6
    calls_per_step = [b[1] - a[1] for a, b in zip(steps, steps[1:] + [(None, len(calls))])]
    assert max(calls_per_step) == 1, "one compute_logits per step"
    assert any({"verify", "chunk"} <= kinds or {"verify", "sample"} <= kinds for kinds, _ in steps), \
        "a step mixed verify rows with others"
    assert llm.llm_engine.spec_decode_stats.num_accepted_tokens > 0
    llm.llm_engine.kv_cache_manager.assert_all_free()
