"""Per-request lists (allowed_token_ids, logit_bias, bad_words, stop, stop_token_ids) are bounded, and a long
one costs its request once, not every row of every step: its vector is built when the request first samples."""
from __future__ import annotations

import pytest
import torch

import vllm.sample.sampler as sampler_module
from vllm.sample.sampler import Sampler, SamplingMetadata
from vllm.sampling_params import (MAX_BAD_WORDS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOKEN_ID_LIST,
                                  SamplingParams)

V = 4096
LONG = 3000  # ids in the long list: far more than a step of these rows may upload


@pytest.mark.parametrize("field, limit, value", [
    ("allowed_token_ids", MAX_TOKEN_ID_LIST, lambda n: [1] * n),
    ("logit_bias", MAX_TOKEN_ID_LIST, lambda n: dict.fromkeys(range(n), 1.0)),
    ("stop_token_ids", MAX_STOP_TOKEN_IDS, lambda n: [1] * n),
    ("stop", MAX_STOP_STRINGS, lambda n: ["x"] * n),
    ("bad_words", MAX_BAD_WORDS, lambda n: ["x"] * n),
])
def test_list_fields_are_bounded_by_name(field, limit, value):
    SamplingParams(**{field: value(limit)})
    with pytest.raises(ValueError, match=f"^{field} must hold at most {limit} entries, got {limit + 1}$"):
        SamplingParams(**{field: value(limit + 1)})


@pytest.fixture
def uploads(monkeypatch):
    """The number of values each host-to-device upload of the sampler carries."""
    sizes: list[int] = []
    real = sampler_module.async_tensor_h2d

    def counting(data, dtype, device):
        t = real(data, dtype, device)
        sizes.append(t.numel())
        return t
    monkeypatch.setattr(sampler_module, "async_tensor_h2d", counting)
    return sizes


def meta(params, banned=None):
    return SamplingMetadata.from_requests(params, [None] * len(params), banned or [[] for _ in params], "cpu")


def test_a_long_list_is_uploaded_once_per_request(uploads):
    torch.manual_seed(0)
    allowed = list(range(100, 100 + LONG))
    long = SamplingParams(temperature=0.0, allowed_token_ids=allowed, logit_bias={150: 5.0, 7: 100.0})
    batch = [long] + [SamplingParams(temperature=0.0)] * 7
    logits = torch.randn(8, V)
    want = logits.argmax(-1)
    restricted = logits[0].clone()
    restricted[150] += 5.0
    want[0] = 100 + restricted[100:100 + LONG].argmax()
    sampler = Sampler()
    assert torch.equal(sampler(logits, meta(batch)).sampled_token_ids, want)
    assert sum(uploads) >= LONG, "the first step builds the vector"
    uploads.clear()
    same = meta(batch)  # a later step: the batch changed (a new metadata), the request did not
    for _ in range(3):
        assert torch.equal(sampler(logits, same).sampled_token_ids, want)
    assert sum(uploads) < 100, f"later steps uploaded {sum(uploads)} values"


def test_a_long_ban_list_costs_only_its_own_row(uploads):
    """min_tokens bans a request's stop ids each step; the other rows are not padded to its list."""
    rows = 64
    banned = [list(range(1, LONG + 1))] + [[]] * (rows - 1)
    params = [SamplingParams(temperature=0.0)] * rows
    logits = torch.randn(rows, V)
    out = Sampler()(logits, meta(params, banned)).sampled_token_ids
    assert out[0] not in banned[0] and torch.equal(out[1:], logits[1:].argmax(-1))
    assert sum(uploads) < 3 * LONG, f"{sum(uploads)} values uploaded for {LONG} banned ids"


def test_logged_params_show_long_lists_by_count_and_skip_defaults():
    params = SamplingParams(max_tokens=5, temperature=0, allowed_token_ids=list(range(200_000)))
    text = repr(params)
    assert text == "SamplingParams(temperature=0.0, max_tokens=5, allowed_token_ids=<200000 entries, first " \
                   "[0, 1, 2, 3, 4, 5, 6, 7]>)"
    assert repr(SamplingParams()) == "SamplingParams()"
