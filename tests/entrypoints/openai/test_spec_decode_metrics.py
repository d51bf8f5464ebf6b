"""`vllm serve --speculative-config`: completions are the same as without speculation, and /metrics carries the
speculative-decoding counters under upstream's names, consistent with each other."""
from __future__ import annotations

import random

import httpx
import pytest

SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'


@pytest.fixture(scope="module")
def servers(start_server):
    return start_server("--max-model-len", "640"), start_server("--max-model-len", "640", "--speculative-config", SPEC)


def test_speculation_is_lossless_and_counted(servers, read_metrics):
    plain, spec = servers
    # Every id the model can emit appears in the prompt, so one-token lookups always find a match and the
    # proposer drafts at every step.
    ids = list(range(3, 512))
    random.Random(0).shuffle(ids)
    body = {"model": "default", "prompt": [ids], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    outs = []
    for server in (plain, spec):
        models = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
        r = httpx.post(server.url + "/v1/completions", json={**body, "model": models[0]["id"]}, timeout=120)
        assert r.status_code == 200, r.text
        outs.append(r.json()["choices"][0]["text"])
    assert outs[0] == outs[1]
    m = read_metrics(spec.url)
    drafts, tokens = m["vllm:spec_decode_num_drafts_total"], m["vllm:spec_decode_num_draft_tokens_total"]
    accepted = m["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and drafts <= tokens <= 3 * drafts
    assert 0 <= accepted <= tokens
    assert m["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == accepted  # summed over positions
    assert "vllm:spec_decode_num_drafts_total" not in read_metrics(plain.url)
