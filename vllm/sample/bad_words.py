"""bad_words (upstream's SamplingParams field): words a request must never generate.

Each word becomes token sequences: as written with its leading space stripped, and with one space before it
(the form it takes inside a sentence; most BPE vocabularies fold the space into the first token). A sequence of
one token is banned at every step. A longer one bans its last token at the steps where the output so far ends
with the rest of it, so the word can never be completed. Like upstream, only the output is matched: a word begun
at the end of the prompt is not.
"""
from __future__ import annotations

from collections.abc import Sequence


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """The distinct token sequences of `words`, each word without and with a leading space."""
    seqs: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in seqs:
                seqs.append(ids)
    return seqs


def banned_by_bad_words(seqs: list[list[int]], output_token_ids: Sequence[int]) -> list[int]:
    """The tokens the next step must not sample: each sequence's last token where the output ends with the rest
    of the sequence."""
    banned = []
    n = len(output_token_ids)
    for seq in seqs:
        k = len(seq) - 1
        if k <= n and all(output_token_ids[n - k + i] == seq[i] for i in range(k)):
            banned.append(seq[-1])
    return banned
