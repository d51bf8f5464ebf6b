"""bad_words: each word's token sequences (with and without a leading space), and the tokens a step bans."""
from __future__ import annotations

import pytest

from vllm import SamplingParams
from vllm.assets import DEFAULT_MODEL_DIR
from vllm.sample.bad_words import bad_words_token_ids, banned_by_bad_words
from vllm.transformers_utils.tokenizer import get_tokenizer


def test_words_become_their_spaced_and_unspaced_sequences():
    tok = get_tokenizer(str(DEFAULT_MODEL_DIR))
    seqs = bad_words_token_ids(tok, ["  return", "return"])  # leading spaces are stripped first: one word
    assert seqs == [tok.encode("return", add_special_tokens=False), tok.encode(" return", add_special_tokens=False)]
    assert all(seqs) and len({tuple(s) for s in seqs}) == len(seqs)


def test_a_sequence_bans_its_last_token_only_after_the_rest():
    seqs = [[7], [3, 4, 5], [9, 4]]
    assert banned_by_bad_words(seqs, []) == [7]
    assert banned_by_bad_words(seqs, [1, 3]) == [7]  # [3, 4, 5] needs 3, 4 first
    assert banned_by_bad_words(seqs, [1, 3, 4]) == [7, 5]
    assert banned_by_bad_words(seqs, [9]) == [7, 4]
    assert banned_by_bad_words(seqs, [3, 4, 8]) == [7]


@pytest.mark.parametrize("words", ["hello", [""], ["  "], [3]])
def test_bad_words_must_be_a_list_of_words(words):
    with pytest.raises(ValueError, match="bad_words must be a list of non-blank strings"):
        SamplingParams(bad_words=words)


def test_an_empty_list_is_no_bad_words():
    assert SamplingParams(bad_words=[]).bad_words is None
    assert not SamplingParams(bad_words=[]).has_logits_processing
