"""Sampler: filters against independently computed allowed sets, distributions, seeding, penalties, logprobs."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm.sample.penalties import PenaltyCounts
from vllm.sample.sampler import Sampler, SamplingMetadata, apply_penalties, gather_logprobs
from vllm.sampling_params import SamplingParams

V = 64
sampler = Sampler()


def meta_for(params, generators=None, prompt=None, output=None, banned=None) -> SamplingMetadata:
    """Penalty counts come from a fresh device-side store, as the engine's do."""
    rows = [[] for _ in params]
    history = [SimpleNamespace(request_id=str(i), prompt_token_ids=p, output_token_ids=o)
               for i, (p, o) in enumerate(zip(prompt or rows, output or rows))]
    return SamplingMetadata.from_requests(params, generators or [None] * len(params), banned or rows, "cpu",
                                          PenaltyCounts(V, "cpu").gather(history))


def draw(logits_row: torch.Tensor, params: SamplingParams, n: int, **rows) -> torch.Tensor:
    """n independent samples of one row, as n identical rows of one batch."""
    meta = meta_for([params] * n, **{k: v * n for k, v in rows.items()})
    return sampler(logits_row.expand(n, -1).clone(), meta).sampled_token_ids


def test_greedy_is_argmax_even_in_a_mixed_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, V)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=5)] * 3
    out = sampler(logits, meta_for(params)).sampled_token_ids
    assert out.dtype == torch.int64
    assert torch.equal(out[0::2], logits[0::2].argmax(-1))
    assert torch.equal(logits, before)  # the caller's logits are never written
    all_greedy = sampler(logits, meta_for([SamplingParams(temperature=0.0)] * 6)).sampled_token_ids
    assert torch.equal(all_greedy, logits.argmax(-1))


def test_top_k_1_equals_greedy():
    torch.manual_seed(1)
    logits = torch.randn(8, V)
    for _ in range(20):
        out = sampler(logits, meta_for([SamplingParams(temperature=1.0, top_k=1)] * 8)).sampled_token_ids
        assert torch.equal(out, logits.argmax(-1))


def allowed_top_k(probs: torch.Tensor, k: int) -> set[int]:
    return set(probs.argsort(descending=True)[:k].tolist())


def allowed_top_p(probs: torch.Tensor, p: float) -> set[int]:
    # Keep a token while the tokens strictly more likely than it hold less than p.
    order = probs.argsort(descending=True)
    before = torch.cumsum(probs[order], 0) - probs[order]
    return set(order[before < p].tolist())


def allowed_min_p(probs: torch.Tensor, min_p: float) -> set[int]:
    return set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())


def allowed_top_k_top_p(probs: torch.Tensor, k: int, p: float) -> set[int]:
    # top-p applies to the top-k survivors, renormalised
    kept = torch.zeros_like(probs)
    top = sorted(allowed_top_k(probs, k))
    kept[top] = probs[top] / probs[top].sum()
    return allowed_top_p(kept, p)


@pytest.mark.parametrize("params, allowed", [
    (SamplingParams(temperature=0.9, top_k=7), lambda p: allowed_top_k(p, 7)),
    (SamplingParams(temperature=0.9, top_p=0.6), lambda p: allowed_top_p(p, 0.6)),
    (SamplingParams(temperature=0.9, min_p=0.2), lambda p: allowed_min_p(p, 0.2)),
    (SamplingParams(temperature=0.9, top_k=10, top_p=0.5), lambda p: allowed_top_k_top_p(p, 10, 0.5)),
], ids=["top_k", "top_p", "min_p", "top_k+top_p"])
def test_filters_never_sample_outside_the_allowed_set(params, allowed):
    torch.manual_seed(2)
    logits = torch.randn(V)
    expected = allowed(torch.softmax(logits.double() / 0.9, -1))
    assert 1 < len(expected) < V // 4, "the case should actually filter"
    seen = set(draw(logits, params, 4000).tolist())
    assert seen <= expected, f"sampled {sorted(seen - expected)} outside the allowed set {sorted(expected)}"
    assert seen == expected  # every allowed token has probability > 1% here, so 4000 draws reach them all


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_empirical_distribution_matches_softmax_over_temperature():
    torch.manual_seed(3)
    vocab = 20
    logits = torch.randn(vocab)
    n = 20000
    counts = torch.bincount(draw(logits, SamplingParams(temperature=0.7), n), minlength=vocab).double()
    probs = torch.softmax(logits.double() / 0.7, -1)
    # 43.82 is the 0.999 quantile of chi-square with 19 degrees of freedom; at temperature 1 instead of 0.7
    # this statistic is in the hundreds.
    assert chi_square(counts, probs) < 43.82
    assert (counts / n - probs).abs().max() < 0.015  # about 5 standard deviations for any p
    assert chi_square(counts, torch.softmax(logits.double(), -1)) > 43.82


def test_top_k_renormalises_over_the_survivors():
    torch.manual_seed(4)
    logits = torch.randn(V)
    n = 20000
    counts = torch.bincount(draw(logits, SamplingParams(temperature=1.0, top_k=5), n), minlength=V).double()
    top = logits.topk(5).indices
    probs = torch.softmax(logits[top].double(), -1)
    assert counts.sum() == counts[top].sum()
    assert chi_square(counts[top], probs) < 18.47  # 0.999 quantile, 4 degrees of freedom


def run_steps(row_params, seed, others, position, steps, logits_per_step):
    """Tokens of one seeded row over several steps, placed at `position` among `others` (params, seed|None)."""
    batch = list(others)
    batch.insert(position, (row_params, seed))
    generators = [None if s is None else torch.Generator().manual_seed(s) for _, s in batch]
    tokens = []
    for step in range(steps):
        logits = torch.randn(len(batch), V) * 3
        logits[position] = logits_per_step[step]
        meta = meta_for([p for p, _ in batch], generators=generators)
        tokens.append(int(sampler(logits, meta).sampled_token_ids[position]))
    return tokens


@pytest.mark.parametrize("row_params", [SamplingParams(temperature=0.8),
                                        SamplingParams(temperature=1.2, top_p=0.9, top_k=20, min_p=0.01)])
def test_seeded_row_is_reproducible_and_independent_of_the_batch(row_params):
    torch.manual_seed(5)
    logits_per_step = torch.randn(20, V) * 1.5
    others = [(SamplingParams(temperature=1.0, top_k=4), 7), (SamplingParams(temperature=0.0), None),
              (SamplingParams(temperature=0.5, top_p=0.8), None), (SamplingParams(min_p=0.1), 123),
              (SamplingParams(temperature=1.0), None)]
    alone = run_steps(row_params, 42, [], 0, 20, logits_per_step)
    torch.manual_seed(99)  # the default RNG state must not matter either
    batched = run_steps(row_params, 42, others, 3, 20, logits_per_step)
    assert alone == batched
    assert run_steps(row_params, 42, others[:2], 1, 20, logits_per_step) == alone
    assert run_steps(row_params, 43, [], 0, 20, logits_per_step) != alone
    assert len(set(alone)) > 3  # the row really samples


def test_unseeded_rows_differ_between_draws():
    torch.manual_seed(6)
    logits = torch.randn(V)
    assert not torch.equal(draw(logits, SamplingParams(), 50), draw(logits, SamplingParams(), 50))


def expected_penalties(logits, prompt, output, presence, frequency, repetition):
    out = logits.clone()
    for t in range(logits.shape[0]):
        if t in prompt or t in output:
            out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
        count = output.count(t)
        out[t] -= frequency * count + presence * (count > 0)
    return out


def test_apply_penalties_changes_exactly_the_expected_logits():
    torch.manual_seed(7)
    logits = torch.randn(3, V)
    logits[0, 5], logits[0, 3] = -1.5, 2.0  # a negative and a positive seen logit
    prompt = [[1, 2, 5], [9], []]
    output = [[3, 3, 5, 60], [], [4, 4, 4]]
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0),
              SamplingParams(repetition_penalty=1.5),
              SamplingParams(presence_penalty=-0.3, frequency_penalty=0.1)]
    meta = meta_for(params, prompt=prompt, output=output)
    got = apply_penalties(logits, meta)
    for i, p in enumerate(params):
        want = expected_penalties(logits[i], prompt[i], output[i], p.presence_penalty, p.frequency_penalty,
                                  p.repetition_penalty)
        torch.testing.assert_close(got[i], want)
    assert (got != logits).sum() == 5 + 1 + 1  # row 0: 1,2,3,5,60; row 1: 9; row 2: 4


def greedy_with(logits_row, prompt=(), output=(), **penalties) -> int:
    meta = meta_for([SamplingParams(temperature=0.0, **penalties)], prompt=[list(prompt)], output=[list(output)])
    return int(sampler(logits_row.unsqueeze(0), meta).sampled_token_ids[0])


def test_penalties_flip_greedy_picks_as_constructed():
    torch.manual_seed(8)
    logits = torch.randn(V) - 4  # every other token far below the two candidates
    a, b = 10, 20
    logits[a], logits[b] = 2.0, 1.7  # a leads by 0.3
    assert greedy_with(logits) == a
    assert greedy_with(logits, output=[a], presence_penalty=0.5) == b
    assert greedy_with(logits, output=[a], presence_penalty=0.2) == a
    assert greedy_with(logits, prompt=[a], presence_penalty=0.5) == a  # presence counts output tokens only
    assert greedy_with(logits, output=[a, a, a], frequency_penalty=0.15) == b  # 0.45 > 0.3
    assert greedy_with(logits, output=[a], frequency_penalty=0.15) == a
    assert greedy_with(logits, prompt=[a], repetition_penalty=1.2) == b  # 2.0 / 1.2 < 1.7: prompt counts here
    assert greedy_with(logits, prompt=[a], repetition_penalty=1.1) == a  # 2.0 / 1.1 > 1.7
    neg = logits - 3.0  # a = -1.0, b = -1.3: a negative logit is multiplied
    assert greedy_with(neg, output=[a], repetition_penalty=1.2) == a  # -1.2 > -1.3
    assert greedy_with(neg, output=[a], repetition_penalty=1.4) == b  # -1.4 < -1.3


def test_banned_ids_are_never_sampled():
    torch.manual_seed(9)
    logits = torch.randn(V)
    banned = logits.topk(3).indices.tolist()
    logits[banned] += 5.0  # without the ban these would win almost every draw
    for params in (SamplingParams(temperature=1.5), SamplingParams(temperature=0.0),
                   SamplingParams(temperature=1.0, top_p=0.5)):
        out = draw(logits, params, 3000, banned=[banned])
        assert not torch.isin(out, torch.tensor(banned)).any()
    masked = logits.clone()
    masked[banned] = float("-inf")
    assert int(draw(logits, SamplingParams(temperature=0.0), 1, banned=[banned])[0]) == int(masked.argmax())


def test_logprobs_are_raw_with_sorted_top_k_and_ranks():
    torch.manual_seed(10)
    logits = torch.randn(6, V) * 2
    params = [SamplingParams(temperature=0.0, logprobs=4), SamplingParams(temperature=1.0, logprobs=2),
              SamplingParams(temperature=1.3, logprobs=0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, presence_penalty=2.0), SamplingParams(temperature=2.0, logprobs=1)]
    output = [[], [], [], [], logits[4].topk(3).indices.tolist(), []]
    out = sampler(logits, meta_for(params, output=output))
    lp = out.logprobs
    raw = torch.log_softmax(logits, -1)
    assert lp.token_ids.shape == lp.logprobs.shape == (6, 5)
    assert torch.equal(lp.token_ids[:, 0], out.sampled_token_ids)
    torch.testing.assert_close(lp.logprobs[:, 0], raw.gather(1, out.sampled_token_ids[:, None])[:, 0])
    assert torch.equal(lp.token_ids[:, 1:], raw.argsort(-1, descending=True)[:, :4])
    assert (lp.logprobs[:, 1:-1] >= lp.logprobs[:, 2:]).all()
    torch.testing.assert_close(lp.logprobs[:, 1:], raw.gather(1, lp.token_ids[:, 1:]))
    expected_ranks = 1 + (raw > raw.gather(1, out.sampled_token_ids[:, None])).sum(-1)
    assert torch.equal(lp.ranks, expected_ranks)
    assert lp.ranks[0] == lp.ranks[3] == 1  # greedy rows without penalties pick the top token
    assert sampler(logits, meta_for([SamplingParams()] * 6)).logprobs is None


def test_gather_logprobs_on_prompt_targets():
    torch.manual_seed(11)
    logprobs = torch.log_softmax(torch.randn(7, V), -1)
    targets = torch.randint(0, V, (7,))
    got = gather_logprobs(logprobs, targets, 3)
    assert torch.equal(got.token_ids[:, 0], targets)
    torch.testing.assert_close(got.logprobs[:, 0], logprobs[torch.arange(7), targets])
    top = logprobs.topk(3)
    assert torch.equal(got.token_ids[:, 1:], top.indices)
    torch.testing.assert_close(got.logprobs[:, 1:], top.values)
    order = logprobs.argsort(-1, descending=True)
    assert torch.equal(got.ranks, (order == targets[:, None]).int().argmax(-1) + 1)
    assert gather_logprobs(logprobs, targets, 0).token_ids.shape == (7, 1)


def test_from_requests_builds_columns_and_flags():
    params = [SamplingParams(temperature=1e-7, top_k=5, logprobs=3), SamplingParams(top_k=-1, top_p=0.5),
              SamplingParams(repetition_penalty=1.1, logprobs=7)]
    meta = meta_for(params)
    assert meta.temperature.tolist() == [0.0, 1.0, 1.0]
    assert meta.top_k.tolist() == [0, 0, 0] and meta.top_k.dtype == torch.int64
    assert meta.max_num_logprobs == 7
    assert (meta.all_greedy, meta.no_penalties, meta.no_min_p, meta.no_top_k_top_p) == (False, False, True, False)
    plain = meta_for([SamplingParams(temperature=0.0)] * 2)
    assert (plain.all_greedy, plain.no_penalties, plain.no_top_k_top_p, plain.max_num_logprobs) == (
        True, True, True, None)
    with pytest.raises(ValueError, match="generators has 1 rows"):
        meta_for(params, generators=[None])


def test_penalty_counts_follow_new_tokens_and_reuse_rows():
    """The store counts each request's prompt once and then only the tokens added since the last step; a
    finished request's row goes to the next one, reset."""
    store = PenaltyCounts(V, "cpu")
    a = SimpleNamespace(request_id="a", prompt_token_ids=[1, 2, 2], output_token_ids=[3])
    b = SimpleNamespace(request_id="b", prompt_token_ids=[], output_token_ids=[])
    counts, seen = store.gather([a, b])
    assert counts[0, 3] == 1 and counts.sum() == 1 and seen[0].nonzero().flatten().tolist() == [1, 2]
    assert not seen[1].any()
    a.output_token_ids += [3, 7]
    b.output_token_ids += [5]
    counts, _ = store.gather([b, a])  # any order: rows follow the requests
    assert counts[1, 3] == 2 and counts[1, 7] == 1 and counts[0, 5] == 1 and counts.sum() == 4
    row_a = store.rows["a"]
    store.prune({"b"})
    c = SimpleNamespace(request_id="c", prompt_token_ids=[9], output_token_ids=[])
    counts, seen = store.gather([c])
    assert store.rows["c"] == row_a and counts.sum() == 0 and seen[0].nonzero().flatten().tolist() == [9]
    for i in range(20):  # more requests than rows: the store grows
        store.gather([SimpleNamespace(request_id=f"x{i}", prompt_token_ids=[i], output_token_ids=[i])])
    assert len(store.rows) == 22 and store.output_counts.shape[0] >= 23
    # An unpenalised row of a batch reads the zero row, which no request ever gets, however many came before.
    d = SimpleNamespace(request_id="d", prompt_token_ids=[4], output_token_ids=[4, 4])
    counts, seen = store.gather([None, d, None])
    assert counts[1, 4] == 2 and seen[1, 4] and counts[[0, 2]].sum() == 0 and not seen[[0, 2]].any()
    assert 0 not in store.rows.values()


def test_logit_bias_and_allowed_token_ids_reshape_exactly_their_rows():
    """Against a reference built by hand: row 0 biased, row 1 restricted, row 2 both, row 3 untouched."""
    torch.manual_seed(7)
    logits = torch.randn(4, V)
    params = [SamplingParams(temperature=0.0, logit_bias={"3": 5.0, 9: -200.0}),
              SamplingParams(temperature=0.0, allowed_token_ids=[1, 40, 63]),
              SamplingParams(temperature=0.0, logit_bias={40: 50.0, 2: 80.0}, allowed_token_ids=[1, 40]),
              SamplingParams(temperature=0.0)]
    want = logits.clone()
    want[0, 3] += 5.0
    want[0, 9] -= 100.0  # clamped to OpenAI's [-100, 100]
    for r, allowed in ((1, [1, 40, 63]), (2, [1, 40])):
        keep = torch.zeros(V, dtype=torch.bool)
        keep[allowed] = True
        want[r] = want[r].masked_fill(~keep, float("-inf"))
    want[2, 40] += 50.0  # token 2's bias is moot: it is not allowed
    out = sampler(logits.clone(), meta_for(params))
    assert out.sampled_token_ids.tolist() == want.argmax(-1).tolist()
    assert out.sampled_token_ids[2] == 40
    assert out.sampled_token_ids[1] in (1, 40, 63)
    # Random rows never leave the allowed set either.
    rand = [SamplingParams(temperature=1.0, allowed_token_ids=[5, 6])] * 64
    assert set(sampler(torch.randn(64, V), meta_for(rand)).sampled_token_ids.tolist()) <= {5, 6}


@pytest.mark.parametrize("kwargs, message", [
    ({"logit_bias": {"x": 1.0}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {1: "a"}}, "logit_bias[1] must be a number"),
    ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
    ({"logprobs": -2}, "logprobs must be"),
])
def test_token_map_fields_name_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kwargs)


def test_logprobs_minus_one_means_the_whole_vocabulary():
    logits = torch.randn(2, V)
    out = sampler(logits, meta_for([SamplingParams(logprobs=-1), SamplingParams(logprobs=2)]))
    assert out.logprobs.token_ids.shape == (2, V + 1)
    torch.testing.assert_close(out.logprobs.logprobs[0, 1:], logits[0].log_softmax(-1).sort(descending=True).values)
