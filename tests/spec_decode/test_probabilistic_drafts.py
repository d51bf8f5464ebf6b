"""DSpark with draft_sample_method "probabilistic": a random request's drafts are sampled from the draft's
distribution at its temperature and verified by the rejection sampler's exact rule against that q, so what comes
out is distributed as sampling without speculation (a two-sample chi-square test over many unseeded requests on
the built-in model); greedy requests still draft the argmax and stay bit-identical."""
from __future__ import annotations

import collections

import pytest
import torch
from code_prompts import CODE_PROMPTS

from vllm import LLM, SamplingParams
from vllm.assets import DEFAULT_DSPARK_DIR
from vllm.worker.drafting import Drafting

PROMPT = "import os\n\ndef read(path):\n    with open("
PROBABILISTIC = {"method": "dspark", "model": str(DEFAULT_DSPARK_DIR), "num_speculative_tokens": 3,
                 "draft_sample_method": "probabilistic"}


def _llm(spec=None, **kwargs) -> LLM:
    return LLM(dtype="float32", max_model_len=256, speculative_config=spec, **kwargs)


def two_sample_chi_square(a: collections.Counter, b: collections.Counter, min_expected: float = 5.0) -> float:
    """The p-value that samples a and b come from one distribution: categories too rare for the test (fewer than
    `min_expected` in both together) are pooled into one."""
    A, B = sum(a.values()), sum(b.values())
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    bins, rest = [], [0, 0]
    for k in keys:
        if a[k] + b[k] >= min_expected:
            bins.append((a[k], b[k]))
        else:
            rest[0] += a[k]
            rest[1] += b[k]
    if sum(rest):
        bins.append(tuple(rest))
    stat = sum((x * (B / A) ** 0.5 - y * (A / B) ** 0.5) ** 2 / (x + y) for x, y in bins)
    df = len(bins) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_greedy_requests_stay_bit_identical():
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in _llm().generate(CODE_PROMPTS[:3], params, use_tqdm=False)]
    llm = _llm(PROBABILISTIC)
    got = llm.generate(CODE_PROMPTS[:3], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert llm.llm_engine.spec_decode_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("temperature", [1.0])
def test_sampled_tokens_follow_the_distribution_without_speculation(temperature, monkeypatch):
    """Tokens 2 and 3 of each request come out of verify rows (token 1 is the prompt's); their marginals over
    300 requests match those of 300 requests without speculation. (The rule's power against a wrong q is shown at
    the sampler: tests/sample/test_rejection_sampler.py; here the draft's q is close to the target's, so the
    end-to-end check is one of integration: the right q reaches the right rows.)"""
    n = 300
    params = SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True)
    prompts = [PROMPT] * n  # short: the prompts' prefill is most of the time otherwise
    plain = _llm(max_num_seqs=256).generate(prompts, params, use_tqdm=False)
    taken = []
    real = Drafting.draft_probs_for

    def spy(out, last):
        probs = real(out, last)
        taken.append(probs.shape)
        return probs
    monkeypatch.setattr(Drafting, "draft_probs_for", staticmethod(spy))
    llm = _llm(PROBABILISTIC, max_num_seqs=256)
    spec = llm.generate(prompts, params, use_tqdm=False)
    vocab = llm.llm_engine.vocab_size
    assert taken and all(shape[1:] == (3, vocab) for shape in taken), "verify steps took the drafts' q"
    stats = llm.llm_engine.spec_decode_stats
    assert stats.num_drafts > n // 2 and stats.num_accepted_tokens > n // 4, "probabilistic drafts were verified"
    for pos in (1, 2):
        a = collections.Counter(o.outputs[0].token_ids[pos] for o in plain)
        b = collections.Counter(o.outputs[0].token_ids[pos] for o in spec)
        assert two_sample_chi_square(a, b) > 1e-3, (pos, a.most_common(8), b.most_common(8))
    llm.llm_engine.kv_cache_manager.assert_all_free()


@pytest.mark.gpu
def test_probabilistic_drafts_in_draft_graphs_on_the_gpu():
    """The draft's graphs sample at each row's temperature (the device RNG inside a CUDA graph): greedy rows stay
    identical to no speculation, random rows verify against the q the graph returned."""
    kwargs = dict(device="cuda", max_num_seqs=16, gpu_memory_utilization=0.3, attention_backend="TRITON_MLA",
                  kda_prefill_backend="torch", kda_decode_backend="native")
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in _llm(**kwargs).generate(CODE_PROMPTS[:4], greedy, use_tqdm=False)]
    llm = _llm(PROBABILISTIC, **kwargs)
    assert llm.llm_engine.runner.drafter.graphs is not None, "the draft runs in graphs"
    assert [o.outputs[0].token_ids for o in llm.generate(CODE_PROMPTS[:4], greedy, use_tqdm=False)] == want
    random = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(CODE_PROMPTS[:4] * 8, random, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    assert llm.llm_engine.spec_decode_stats.num_accepted_tokens > 0
    llm.llm_engine.kv_cache_manager.assert_all_free()
