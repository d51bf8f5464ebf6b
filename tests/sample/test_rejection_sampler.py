"""Rejection sampler over ragged rows: greedy exactness, placeholders, bonus, distributions (chi-square), seeding."""
from __future__ import annotations

import pytest
import torch

from vllm.sample.rejection_sampler import (PLACEHOLDER_TOKEN_ID, RejectionSampler, SpecDecodeMetadata, greedy_verify,
                                           num_accepted, target_probs)
from vllm.sample.sampler import Sampler, SamplingMetadata
from vllm.sampling_params import SamplingParams

V = 32
rs = RejectionSampler()


def sampling_for(params, generators=None) -> SamplingMetadata:
    return SamplingMetadata.from_requests(params, generators or [None] * len(params), [[] for _ in params], "cpu")


def chi_square_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square of the sample counts against probs (bins with expectation < 5 pooled)."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    if counts[expected == 0].sum() > 0:  # a token with target probability 0 was emitted
        return 0.0
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if obs.numel() < 2:
        return 1.0  # a single (pooled) bin: nothing to test
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2).item()


def test_greedy_ragged_hand_built():
    torch.manual_seed(0)
    counts = [0, 1, 3, 2, 3]
    logits = torch.randn(sum(counts) + len(counts), V)
    am = logits.argmax(-1).tolist()
    wrong = lambda row: (am[row] + 1) % V
    # rows: req0 [0]; req1 [1,2]; req2 [3,4,5,6]; req3 [7,8,9]; req4 [10,11,12,13]
    drafts = [
        [],  # bonus only
        [am[1]],  # match -> bonus
        [am[3], wrong(4), am[5]],  # mismatch at position 1 (a later match does not count)
        [wrong(7), am[8]],  # mismatch at position 0
        [am[10], am[11], am[12]],  # all accepted -> bonus
    ]
    meta = SpecDecodeMetadata.from_drafts(drafts, "cpu")
    before = logits.clone()
    out = rs(logits, None, meta, sampling_for([SamplingParams(temperature=0.0)] * 5))
    expected = torch.tensor([
        [am[0], -1, -1, -1],
        [am[1], am[2], -1, -1],
        [am[3], am[4], -1, -1],
        [am[7], -1, -1, -1],
        [am[10], am[11], am[12], am[13]],
    ])
    assert out.dtype == torch.int64
    assert torch.equal(out, expected)
    assert num_accepted(out).tolist() == [0, 1, 1, 0, 3]
    assert torch.equal(logits, before)


def test_placeholders_always_rejected():
    torch.manual_seed(1)
    drafts = [[-1, -1], [5, -1, 7], [-1]]
    logits = torch.randn(3 + 4 + 2, V) * 0.1
    # Make the real drafts the argmax where they are, so only the placeholder stops them.
    logits[3, 5] = 10.0
    logits[5, 7] = 10.0
    meta = SpecDecodeMetadata.from_drafts(drafts, "cpu")
    am = logits.argmax(-1)
    out = rs(logits, None, meta, sampling_for([SamplingParams(temperature=0.0)] * 3))
    assert out.tolist() == [[am[0].item(), -1, -1, -1], [5, am[4].item(), -1, -1], [am[7].item(), -1, -1, -1]]
    # Random rows, even with a target that puts (almost) all mass somewhere: a placeholder is never accepted and the
    # token emitted there is a real token.
    params = [SamplingParams(temperature=1.0)] * 3
    for draft_probs in (None, torch.softmax(torch.randn(6, V), -1)):
        for _ in range(20):
            out = rs(logits, draft_probs, meta, sampling_for(params))
            acc = num_accepted(out).tolist()
            assert acc[0] == 0 and acc[2] == 0 and acc[1] <= 1
            assert (out[:, 0] >= 0).all()


def test_zero_draft_rows_are_plain_sampling():
    torch.manual_seed(2)
    logits = torch.randn(6, V)
    meta = SpecDecodeMetadata.from_drafts([[]] * 6, "cpu")
    greedy = sampling_for([SamplingParams(temperature=0.0)] * 6)
    out = rs(logits, None, meta, greedy)
    assert out.shape == (6, 1)
    assert torch.equal(out[:, 0], Sampler()(logits, greedy).sampled_token_ids)
    # Random zero-draft rows: bonus ~ p.
    n = 20000
    row = torch.randn(1, 8)
    meta = SpecDecodeMetadata.from_drafts([[]] * n, "cpu")
    out = rs(row.expand(n, -1).clone(), None, meta, sampling_for([SamplingParams(temperature=1.0)] * n))
    assert chi_square_pvalue(out[:, 0], row[0].softmax(-1)) > 1e-3


@pytest.mark.parametrize("use_draft_probs", [True, False])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5, top_p=0.9),
                                    SamplingParams(temperature=1.0, min_p=0.05)])
def test_emitted_tokens_follow_target_distribution(use_draft_probs, params):
    """Drafts sampled from q != p: first emitted token ~ p0; given draft 1 accepted, the next token ~ p1; given both
    accepted, the bonus ~ p2. Holds for a real q and for ngram's one-hot q alike."""
    gen = torch.Generator().manual_seed(3)
    v, n, k = 8, 20000, 2
    target_rows = torch.randn(k + 1, v, generator=gen) * 1.5
    q = torch.softmax(torch.randn(k, v, generator=gen) * 1.5, -1)
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=gen) for j in range(k)], 1)
    meta = SpecDecodeMetadata(drafts.reshape(-1), [k] * n,
                              torch.arange(0, (k + 1) * (n + 1), k + 1, dtype=torch.int32))
    logits = target_rows.repeat(n, 1)
    draft_probs = q.repeat(n, 1) if use_draft_probs else None
    sampling = sampling_for([params] * n)
    torch.manual_seed(4)
    out = rs(logits, draft_probs, meta, sampling)
    # The target as Sampler's random-path processing defines it.
    p = target_probs(target_rows, sampling.temperature[:k + 1], sampling.min_p[:k + 1], sampling.top_k[:k + 1],
                     sampling.top_p[:k + 1], sampling)
    # ... and it is what the plain Sampler draws from.
    plain = Sampler()(target_rows[:1].expand(n, -1).clone(), sampling).sampled_token_ids
    assert chi_square_pvalue(plain, p[0]) > 1e-3
    acc = num_accepted(out)
    assert chi_square_pvalue(out[:, 0], p[0]) > 1e-3
    assert (acc >= 1).sum() >= 500  # enough accepted first drafts for the conditional test to mean something
    assert chi_square_pvalue(out[acc >= 1, 1], p[1]) > 1e-3
    if (acc >= 2).sum() >= 500:
        assert chi_square_pvalue(out[acc >= 2, 2], p[2]) > 1e-3
    # Power check: the same statistic rejects the draft distribution.
    assert chi_square_pvalue(drafts[:, 0], p[0]) < 1e-6
    # Acceptance rate of draft 0 matches sum_x min(p, q).
    rate = (acc >= 1).double().mean().item()
    # Drafts come from q either way: with q known, accept w.p. sum min(p, q); as ngram (one-hot), x w.p. p(x).
    expected = (torch.minimum(p[0], q[0]).sum() if use_draft_probs else (q[0] * p[0]).sum()).item()
    assert abs(rate - expected) < 0.02


def test_seeded_rows_are_batch_independent():
    torch.manual_seed(5)
    seeded_logits = torch.randn(4, V) * 0.3  # flat target: acceptance is genuinely random
    seeded_drafts = [3, 9, 4]
    seeded_q = torch.softmax(torch.randn(3, V), -1)
    params = SamplingParams(temperature=1.0, top_p=0.95)
    results = []
    for seed in range(8):
        alone = rs(seeded_logits, seeded_q, SpecDecodeMetadata.from_drafts([seeded_drafts], "cpu"),
                   sampling_for([params], [torch.Generator().manual_seed(seed)]))
        other_logits = torch.randn(2 + 5 + 1, V)
        batch_logits = torch.cat([other_logits[:2], seeded_logits, other_logits[2:]])
        batch_q = torch.cat([torch.softmax(torch.randn(1, V), -1), seeded_q, torch.softmax(torch.randn(4, V), -1)])
        meta = SpecDecodeMetadata.from_drafts([[1], seeded_drafts, [2, 2, 2, 2], []], "cpu")
        torch.rand(17)  # the default stream moves between the two calls
        batch = rs(batch_logits, batch_q, meta,
                   sampling_for([SamplingParams(temperature=0.9), params, SamplingParams(temperature=0.0),
                                 SamplingParams(temperature=1.0)],
                                [None, torch.Generator().manual_seed(seed), None, None]))
        assert batch.shape == (4, 5)
        assert torch.equal(batch[1, :4], alone[0]) and batch[1, 4] == -1
        results.append(tuple(alone[0].tolist()))
    assert len(set(results)) > 1  # the seed matters


def test_lossless_at_temperature_zero():
    """Greedy rows (also mixed with random rows, and with draft_probs given) emit exactly the target's greedy tokens:
    every emitted token equals the argmax of its row, and drafts that match are all kept."""
    gen = torch.Generator().manual_seed(6)
    sampler = Sampler()
    for trial in range(30):
        counts = torch.randint(0, 5, (7,), generator=gen).tolist()
        logits = torch.randn(sum(counts) + 7, V, generator=gen)
        am = logits.argmax(-1)
        drafts, row = [], 0
        for c in counts:
            d = [am[row + j].item() if torch.rand(1, generator=gen) < 0.75 else
                 torch.randint(0, V, (1,), generator=gen).item() for j in range(c)]
            drafts.append(d)
            row += c + 1
        meta = SpecDecodeMetadata.from_drafts(drafts, "cpu")
        params = [SamplingParams(temperature=0.0) if i % 2 == 0 or trial % 3 == 0 else SamplingParams(temperature=1.0)
                  for i in range(7)]
        draft_probs = torch.softmax(torch.randn(sum(counts), V, generator=gen), -1) if trial % 2 else None
        out = rs(logits, draft_probs, meta, sampling_for(params))
        greedy_all = sampler(logits, sampling_for([SamplingParams(temperature=0.0)] * logits.shape[0]))
        row = 0
        for r, c in enumerate(counts):
            if params[r].temperature == 0.0:
                ref = greedy_all.sampled_token_ids[row:row + c + 1].tolist()
                expected_accepted = next((j for j in range(c) if drafts[r][j] != ref[j]), c)
                got = out[r].tolist()
                assert got[:expected_accepted + 1] == ref[:expected_accepted + 1]
                assert all(t == -1 for t in got[expected_accepted + 1:])
            row += c + 1


def test_width_follows_max_spec_len():
    logits = torch.randn(3, V)
    meta = SpecDecodeMetadata.from_drafts([[logits[0].argmax().item()], []], "cpu")
    out = rs(logits, None, meta, sampling_for([SamplingParams(temperature=0.0)] * 2), max_spec_len=4)
    assert out.shape == (2, 5)
    assert out[0].tolist() == [logits[0].argmax().item(), logits[1].argmax().item(), -1, -1, -1]
    assert out[1].tolist() == [logits[2].argmax().item(), -1, -1, -1, -1]
    assert RejectionSampler.num_accepted(out).tolist() == [1, 0]


@pytest.mark.parametrize("seed", range(4))
def test_greedy_verify_equals_the_rejection_sampler(seed):
    """The graph-side greedy verification over a step's token layout (current token, then drafts, per row)
    gives the rejection sampler's greedy rows, for ragged rows with placeholders and near-misses, and leaves
    padding rows (no tokens) and padded tokens out of the real rows."""
    gen = torch.Generator().manual_seed(seed)
    K = 4
    counts = torch.randint(0, K + 1, (6,), generator=gen).tolist()
    T = sum(counts) + len(counts)
    logits = torch.randn(T + 3, V, generator=gen)  # 3 padded tokens past the step's
    argmax = logits.argmax(-1)
    step_tokens = torch.randint(0, V, (T + 3,), generator=gen)
    qsl = torch.tensor([0] + torch.tensor(counts).add(1).cumsum(0).tolist() + [T, T], dtype=torch.int32)
    drafts = []
    for r, c in enumerate(counts):  # most drafts right, some wrong, a few placeholders
        s0 = int(qsl[r])
        row = [int(argmax[s0 + j]) if torch.rand((), generator=gen) < 0.7 else int(step_tokens[s0 + 1 + j])
               for j in range(c)]
        row = [PLACEHOLDER_TOKEN_ID if torch.rand((), generator=gen) < 0.1 else t for t in row]
        step_tokens[s0 + 1:s0 + 1 + c] = torch.tensor(row, dtype=torch.int64)
        drafts.append(row)
    want = rs(logits[:T], None, SpecDecodeMetadata.from_drafts(drafts, "cpu"),
              sampling_for([SamplingParams(temperature=0.0)] * len(counts)), max_spec_len=K)
    got = greedy_verify(argmax, step_tokens, qsl, K)
    assert got.shape == (len(counts) + 2, K + 1)
    assert torch.equal(got[:len(counts)], want)
    assert bool((got[len(counts):, 1:] == PLACEHOLDER_TOKEN_ID).all())


def test_greedy_verify_stops_at_a_rows_draft_count_when_its_bonus_equals_the_next_rows_token():
    """Row 0 keeps both its drafts; its bonus argmax is the token the next row starts with, which sits where a
    third draft of row 0 would: it must not be taken for one."""
    K = 3
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32)
    step_tokens = torch.tensor([10, 11, 12, 40, 41])  # row 0: current 10, drafts 11, 12; row 1: current 40, draft 41
    argmax = torch.tensor([11, 12, 40, 7, 8])  # row 0 accepts 11, 12; its bonus is 40 = row 1's first token
    out = greedy_verify(argmax, step_tokens, qsl, K)
    assert out.tolist() == [[11, 12, 40, PLACEHOLDER_TOKEN_ID], [7, PLACEHOLDER_TOKEN_ID, PLACEHOLDER_TOKEN_ID,
                                                                 PLACEHOLDER_TOKEN_ID]]


def test_per_request_draft_probs_equal_the_flat_layout():
    """draft_probs as [B, K, V] (probabilistic DSpark drafts, per request and position) verify exactly as the
    flat [num_drafts, V] layout, with ragged rows (0..K drafts) and the same random stream."""
    gen = torch.Generator().manual_seed(9)
    v, K = 8, 3
    counts = [3, 0, 1, 2, 3, 1]
    q = torch.softmax(torch.randn(len(counts), K, v, generator=gen), -1)
    drafts = [torch.multinomial(q[r, :c], 1, generator=gen).squeeze(1).tolist() if c else []
              for r, c in enumerate(counts)]
    meta = SpecDecodeMetadata.from_drafts(drafts, "cpu")
    logits = torch.randn(sum(counts) + len(counts), v, generator=gen)
    flat = torch.cat([q[r, :c] for r, c in enumerate(counts)])
    sampling = sampling_for([SamplingParams(temperature=1.0)] * len(counts))
    outs = []
    for probs in (flat, q):
        torch.manual_seed(5)
        outs.append(RejectionSampler()(logits, probs, meta, sampling, max_spec_len=K))
    assert torch.equal(outs[0], outs[1])
