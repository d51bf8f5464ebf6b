"""Beam search ends a beam at any of the model's end-of-sequence ids (config.json's, generation_config.json's,
the tokenizer's), not only the tokenizer's own."""
from __future__ import annotations

from vllm.beam_search import beam_search
from vllm.outputs import CompletionOutput, Logprob, RequestOutput
from vllm.sampling_params import BeamSearchParams

EXTRA_EOS = 9  # e.g. a chat model's <|im_end|>, listed only in generation_config.json


def fake_generate(batch, params):
    """Every beam's next-token candidates: EXTRA_EOS is the likeliest, then 5 and 6."""
    row = {EXTRA_EOS: Logprob(-0.1, 1), 5: Logprob(-1.0, 2), 6: Logprob(-2.0, 3)}
    return [RequestOutput("r", None, p["prompt_token_ids"], None, [CompletionOutput(0, "", [EXTRA_EOS], None, [row])],
                          True) for p in batch]


def test_an_extra_eos_id_finishes_beams():
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    out = beam_search(fake_generate, None, [[1, 2]], params, frozenset({2, EXTRA_EOS}))[0]
    best = out.sequences[0]
    assert best.tokens == [1, 2, EXTRA_EOS] and best.finish_reason == "stop" and best.stop_reason == EXTRA_EOS
    unaware = beam_search(fake_generate, None, [[1, 2]], params, frozenset({2}))[0]
    assert all(b.finish_reason == "length" and len(b.tokens) == 5 for b in unaware.sequences)
