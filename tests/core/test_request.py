"""Request.all_token_ids: the proposer's per-step view of prompt + outputs, kept in step with the lists."""
from __future__ import annotations

import numpy as np
import pytest

from vllm.core.request import Request
from vllm.sampling_params import SamplingParams


def test_all_token_ids_follows_appended_outputs_and_grows_in_place():
    rng = np.random.default_rng(0)
    prompt = rng.integers(5, 1000, 7).tolist()
    req = Request("r", prompt, SamplingParams(max_tokens=200), max_tokens=200)
    assert req.all_token_ids().tolist() == prompt
    buf = req._token_buf
    for step in range(60):  # 1..4 tokens per step, as verify steps append them
        req.output_token_ids.extend(rng.integers(5, 1000, 1 + step % 4).tolist())
        view = req.all_token_ids()
        assert view.tolist() == prompt + req.output_token_ids
    assert req._token_buf is not buf, "the buffer grew past its first capacity"
    with pytest.raises(ValueError):
        view[0] = 1  # read-only: a proposer cannot corrupt the request's tokens

