"""NgramProposer against hand-built cases, a brute-force reference and a port of upstream's KMP search;
SpeculativeConfig validation."""
from __future__ import annotations

import json

import numpy as np
import pytest

from vllm.config import SpeculativeConfig
from vllm.spec_decode.ngram import NgramProposer


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int, max_model_len: int | None = None) -> list[int]:
    """Longest n in [min_n, max_n] whose suffix n-gram occurs earlier; earliest occurrence; up to k tokens after."""
    length = len(tokens)
    if max_model_len is not None:
        k = min(k, max_model_len - length)
    if k <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        if n > length - 1:
            continue
        suffix = tokens[length - n:]
        for start in range(length - n):  # occurrence tokens[start:start+n], ending before the last position
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def upstream_kmp(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Pure-Python port of upstream vLLM v1's KMP search over the reversed tokens."""
    total = len(tokens)
    if total < min_n:
        return []
    rev = tokens[::-1]
    lps = [0] * max_n
    longest, position, prev, i = 0, 0, 0, 1
    while i < total:
        if rev[prev] == rev[i]:
            prev += 1
            if prev >= longest:
                longest, position = prev, i
            if i < max_n:
                lps[i] = prev
            if prev == max_n:
                prev = lps[max_n - 1]
            i += 1
        elif prev != 0:
            prev = lps[prev - 1]
        else:
            i += 1
    if longest < min_n:
        return []
    start = total - 1 - position + longest
    return tokens[start:start + min(k, total - start)]


def test_repetitive_text_drafts_k_tokens_continuing_the_pattern():
    p = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    seq = [1, 2, 3, 4, 5] * 3 + [1, 2]
    assert p.propose(seq) == [3, 4, 5]
    assert p.propose(np.array(seq, dtype=np.int64)) == [3, 4, 5]


def test_no_repeat_gives_no_drafts():
    p = NgramProposer(3, 1, 4)
    assert p.propose(list(range(50))) == []
    assert p.propose([]) == []
    assert p.propose([7]) == []


def test_match_near_end_gives_fewer_than_k():
    p = NgramProposer(5, 1, 3)
    # suffix [8, 9] occurred once, followed by only [6, 8, 9] before the sequence ends
    assert p.propose([1, 2, 3, 8, 9, 6, 8, 9]) == [6, 8, 9]
    # overlapping self-match: the only earlier occurrence of [5, 5] ends one token before the suffix
    assert p.propose([1, 5, 5, 5]) == [5]


def test_longest_ngram_preferred_over_shorter_more_recent_one():
    p = NgramProposer(2, 1, 3)
    # [1, 2, 3] occurs at the start (then 10, 11); [2, 3] alone occurs more recently (then 20, 21)
    seq = [1, 2, 3, 10, 11, 7, 2, 3, 20, 21, 1, 2, 3]
    assert p.propose(seq) == [10, 11]
    # capped at max_n = 2: [2, 3] ties, and the earliest occurrence wins
    assert NgramProposer(2, 1, 2).propose(seq) == [10, 11]
    seq2 = [9, 2, 3, 20, 21, 1, 2, 3, 10, 11, 1, 2, 3]
    assert NgramProposer(2, 1, 2).propose(seq2) == [20, 21]
    assert NgramProposer(2, 1, 3).propose(seq2) == [10, 11]


def test_min_and_max_bounds_respected():
    seq = [4, 1, 2, 3, 5, 6, 9, 3]  # only a 1-gram ([3]) repeats
    assert NgramProposer(2, 1, 4).propose(seq) == [5, 6]
    assert NgramProposer(2, 2, 4).propose(seq) == []
    # a 3-gram repeats, but max_n = 2 cannot see past the 2-gram; with min_n = 3 the 3-gram still drafts
    seq = [7, 1, 2, 30, 8, 1, 2, 40, 7, 1, 2]
    assert NgramProposer(1, 1, 2).propose(seq) == [30]
    assert NgramProposer(1, 3, 3).propose(seq) == [30]
    assert NgramProposer(1, 4, 5).propose(seq) == []
    assert NgramProposer(1, 3, 3).propose([1, 2]) == []  # shorter than min_n


def test_max_model_len_caps_drafts():
    seq = [1, 2, 3, 4, 5] * 3 + [1, 2]
    assert NgramProposer(3, 1, 3, max_model_len=len(seq) + 2).propose(seq) == [3, 4]
    assert NgramProposer(3, 1, 3, max_model_len=len(seq)).propose(seq) == []


def test_propose_batch():
    p = NgramProposer(2, 1, 3)
    batch = [[1, 2, 3, 1, 2], list(range(10)), np.array([5, 5, 5])]
    assert p.propose_batch(batch) == [[3, 1], [], [5]]
    assert p.propose_batch([]) == []


@pytest.mark.parametrize("vocab", [2, 3, 5])
def test_matches_brute_force_and_upstream_kmp_on_random_sequences(vocab):
    rng = np.random.default_rng(1234 + vocab)
    for _ in range(1500):
        length = int(rng.integers(0, 30))
        tokens = rng.integers(0, vocab, size=length).tolist()
        k = int(rng.integers(1, 6))
        min_n = int(rng.integers(1, 5))
        max_n = min_n + int(rng.integers(0, 4))
        p = NgramProposer(k, min_n, max_n)
        want = brute_force(tokens, k, min_n, max_n)
        assert p.propose(tokens) == want, (tokens, k, min_n, max_n)
        assert upstream_kmp(tokens, k, min_n, max_n) == want, (tokens, k, min_n, max_n)
        mml = length + int(rng.integers(-1, 4))
        assert NgramProposer(k, min_n, max_n, mml).propose(tokens) == brute_force(tokens, k, min_n, max_n, mml)


def test_long_sequence_is_fast():
    import time
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, size=200_000)
    tokens[-3:] = tokens[1000:1003]
    p = NgramProposer(4, 1, 8)
    t0 = time.perf_counter()
    for _ in range(20):
        out = p.propose(tokens)
    assert (time.perf_counter() - t0) / 20 < 0.05
    assert out == tokens[1003:1007].tolist()


def test_proposer_rejects_bad_arguments():
    with pytest.raises(ValueError):
        NgramProposer(0)
    with pytest.raises(ValueError):
        NgramProposer(2, 3, 2)
    with pytest.raises(ValueError):
        NgramProposer(2, 0, 2)


# ---- SpeculativeConfig ----

def test_config_from_json_string_and_dict():
    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
    cfg = SpeculativeConfig.from_json(text)
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 3, 2, 4)
    assert SpeculativeConfig.from_json(json.loads(text)) == cfg
    p = NgramProposer.from_config(cfg)
    assert (p.k, p.min_n, p.max_n) == (3, 2, 4)


def test_config_defaults():
    cfg = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 2})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (1, 4)
    cfg = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 6})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (6, 6)
    cfg = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (1, 2)


@pytest.mark.parametrize("payload, match", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0 is invalid"),
    ({"method": "ngram", "num_speculative_tokens": -1}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     r"prompt_lookup_max=2 is invalid: expected an integer >= prompt_lookup_min=3"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min=0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3},
     (r"keys=\['lookahead'\] is invalid: expected for method 'ngram' only the keys method, num_speculative_tokens, "
      r"prompt_lookup_min, prompt_lookup_max")),
    ({"method": "eagle", "num_speculative_tokens": 2}, r"method='eagle' is invalid: expected one of 'ngram', 'dspark'"),
    ({"method": "dspark", "num_speculative_tokens": 2, "model": "/nonexistent"}, "no config.json there"),
    ({"method": "dspark", "num_speculative_tokens": 2}, "model=None is invalid: expected the directory of a DSpark"),
    ({"method": "dspark", "num_speculative_tokens": 2, "model": "x", "prompt_lookup_min": 1},
     r"expected for method 'dspark' only the keys"),
    ({"method": "dspark", "num_speculative_tokens": 2, "model": "x", "draft_sample_method": "topk"},
     "draft_sample_method='topk' is invalid"),
    ({"method": "dspark", "num_speculative_tokens": 2, "model": "x", "enable_adaptive_verification": "yes"},
     "enable_adaptive_verification='yes' is invalid: expected true or false"),
    ({"num_speculative_tokens": 2}, "'method' key"),
    ({"method": "ngram"}, "'num_speculative_tokens' key"),
    ('{"method": "ngram", "num_speculative_tokens": 3', "is not valid JSON"),
    ("[1, 2]", "a JSON object"),
])
def test_config_validation_errors(payload, match):
    with pytest.raises(ValueError, match=match) as info:
        SpeculativeConfig.from_json(payload)
    assert "--speculative-config" in str(info.value)


def test_config_direct_construction_validates():
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="DSpark draft checkpoint"):
        SpeculativeConfig(method="dspark", num_speculative_tokens=2)
