"""`vllm serve --speculative-config`: completions are the same as without speculation, and /metrics carries the
speculative-decoding counters under upstream's names, consistent with each other."""
from __future__ import annotations

import httpx
import pytest

SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'


@pytest.fixture(scope="module")
def servers(start_server):
    return start_server("--max-model-len", "640"), start_server("--max-model-len", "640", "--speculative-config", SPEC)


def test_speculation_is_lossless_and_counted(servers, read_metrics):
    plain, spec = servers
    # The built-in model is trained on Python: its greedy code repeats the prompt's and its own identifiers, so
    # ngram drafts are proposed and some are accepted.
    prompts = ["class Stack:\n    def __init__(self):\n", "def fibonacci(n):\n"]
    body = {"model": "default", "prompt": prompts, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    outs = []
    for server in (plain, spec):
        models = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
        r = httpx.post(server.url + "/v1/completions", json={**body, "model": models[0]["id"]}, timeout=120)
        assert r.status_code == 200, r.text
        outs.append([c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])])
    assert outs[0] == outs[1]
    m = read_metrics(spec.url)
    drafts, tokens = m["vllm:spec_decode_num_drafts_total"], m["vllm:spec_decode_num_draft_tokens_total"]
    accepted = m["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and drafts <= tokens <= 3 * drafts
    assert 0 < accepted <= tokens
    assert m["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == accepted  # summed over positions
    assert "vllm:spec_decode_num_drafts_total" not in read_metrics(plain.url)


def test_adaptive_verification_counters_are_rendered_with_it_only():
    """/metrics carries adaptive verification's counters (our names: upstream has none) when the engine reports
    them, and not for fixed-K speculation."""
    import dataclasses
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from vllm.engine.core import EngineStats
    from vllm.entrypoints.openai.metrics import Metrics
    from vllm.spec_decode.metrics import SpecDecodeStats

    def rendered(spec: SpecDecodeStats) -> dict[str, float]:
        stats = EngineStats(0, 0, 0.0, 0.0, 1, 1, 1, 1, 0, 0, spec)
        cache = SimpleNamespace(block_size=16, gpu_memory_utilization=0.9, enable_prefix_caching=True)
        engine = SimpleNamespace(stats=lambda: stats, config=SimpleNamespace(cache_config=cache))
        text = Metrics(engine, "m").render().decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    fixed = SpecDecodeStats(3, num_drafts=2, num_draft_tokens=6, num_accepted_tokens=3)
    assert not any("unverified" in name or "remeasure" in name for name in rendered(fixed))
    m = rendered(dataclasses.replace(fixed, num_unverified_draft_tokens=2, num_remeasure_steps=1))
    assert m["vllm:spec_decode_num_unverified_draft_tokens_total"] == 2
    assert m["vllm:spec_decode_num_remeasure_steps_total"] == 1
    assert m["vllm:spec_decode_num_draft_tokens_total"] == 6
