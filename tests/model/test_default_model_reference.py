"""The built-in trained model against the float64 reference of kimi_k3_model.md (k3_reference.ref_logits).

Its logits are peaked (trained on Python), so a wrong token is a real difference and not a near-tie: the
engine's logits on held-out standard-library code match the reference's, and the engine's greedy continuation
of code prompts is the reference's greedy continuation.
"""
from __future__ import annotations

import pytest
from code_prompts import CODE_PROMPTS, heldout_code_ids
from k3_reference import ref_logits
from sequence_runner import SequenceRunner

from vllm import LLM, SamplingParams
from vllm.assets import DEFAULT_MODEL_DIR
from vllm.model_executor.model_loader import load_model
from vllm.transformers_utils.tokenizer import get_tokenizer

PROMPTS = CODE_PROMPTS[:3]


@pytest.fixture(scope="module")
def model():
    return load_model(DEFAULT_MODEL_DIR, "float32")


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer(DEFAULT_MODEL_DIR)


def test_logits_equal_the_float64_reference(model, tokenizer):
    tokens = heldout_code_ids(tokenizer, [96])[0]
    got = SequenceRunner(model, max_model_len=128).forward_whole(tokens).double()
    want = ref_logits(model, tokens)
    err = (got - want).norm() / want.norm()
    assert err < 2e-6, err
    top2 = want.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.3, "the model's logits are meant to be peaked"
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_greedy_equals_the_float64_reference(model, tokenizer):
    max_tokens = 24
    llm = LLM(dtype="float32", max_model_len=256)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        seq = list(out.prompt_token_ids)
        for _ in range(max_tokens):
            seq.append(int(ref_logits(model, seq)[-1].argmax()))
        assert out.outputs[0].token_ids == seq[len(out.prompt_token_ids):], prompt
    llm.llm_engine.kv_cache_manager.assert_all_free()
