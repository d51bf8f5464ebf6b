"""Adaptive verification's budget (vllm/spec_decode/adaptive_verification/): the cost curves, b*, the host's even
split and the device's survival split, against hand-computed cases."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.spec_decode.adaptive_verification import (AdaptiveVerifier, CostCurve, DraftConfidences, StepTimes,
                                                    SurvivalCalibration, SurvivalPrediction, VerifyCosts,
                                                    choose_budget, device_split, even_split)
from vllm.spec_decode.adaptive_verification import calibration as calibration_module
from vllm.spec_decode.adaptive_verification import step_times as step_times_module


def _flat_draft():
    return CostCurve.from_samples({1: [0.0], 64: [0.0]}, max_captured=64)


def test_cost_curve_is_monotone_a_step_function_inside_the_captures_and_linear_beyond():
    curve = CostCurve.from_samples({1: [1.0, 9.0, 1.2], 4: [0.8], 8: [2.0], 16: [3.0], 24: [5.0], 32: [6.0]},
                                   max_captured=16, floor=1e-6)
    assert curve(1) == pytest.approx(1.2)  # the median of the samples
    assert curve(4) == pytest.approx(1.2)  # a running max: 0.8 is raised to 1.2
    assert curve(5) == curve(8) == pytest.approx(2.0)  # padded up to the 8-token graph
    assert curve(16) == pytest.approx(3.0)
    assert curve(20) == pytest.approx(4.0)  # interpolated above the largest graph
    assert curve(40) == pytest.approx(7.0)  # extrapolated from the last two points
    assert all(curve(n) <= curve(n + 1) for n in range(1, 60))
    sizes = np.array([0, 1, 5, 17, 40, 300, 3])  # the table the budget reads: the same values, any order
    assert curve.at(sizes).tolist() == [curve(int(n)) for n in sizes]


def test_a_100x_verify_cost_jump_admits_only_the_most_confident_draft():
    verify = CostCurve.from_samples({4: [1.0], 5: [1.0], 6: [100.0], 12: [100.0]}, max_captured=12)
    costs = VerifyCosts(_flat_draft(), verify)
    # Four requests with one token each (T0 = 4): b = 1 costs nothing more; b = 2 costs 100x.
    b = choose_budget(np.array([0.3, 0.9, 0.2, 0.25]), num_non_draft_tokens=4, num_sampling_reqs=4, num_reqs=4,
                      max_total_logits=1024, num_bonus=1, costs=costs)
    assert b == 1


def test_budget_grows_with_confidence_when_verifying_is_cheap_and_stops_at_the_chunk():
    verify = CostCurve.from_samples({n: [1.0 + 0.01 * n] for n in (1, 8, 16, 32, 64)}, max_captured=64)
    costs = VerifyCosts(_flat_draft(), verify)
    sure = np.full(12, 0.95)
    assert choose_budget(sure, 4, 4, 4, 1024, 1, costs) == 12
    # Unlikely drafts: only those that ride in the 8-token graph's padding for free (4 tokens + 4 drafts) ...
    assert choose_budget(np.full(12, 0.001), 4, 4, 4, 1024, 1, costs) == 4
    # ... and none when the step already fills its graph.
    assert choose_budget(np.full(12, 0.001), 8, 8, 8, 1024, 1, costs) == 0
    # One rejection-sampler chunk of 10 logits holds 4 bonus rows and 6 drafts.
    assert choose_budget(sure, 4, 4, 4, 10, 1, costs) == 6


def _h200_tables_at_8_requests() -> VerifyCosts:
    """The H200's tables at 8 requests of 3 drafts (ms, 93d5c70): verifying 16 tokens cost 1.47, 24 or 32 cost
    2.30, the draft 0.3."""
    verify = CostCurve.from_samples({8: [1.2], 16: [1.47], 24: [2.30], 32: [2.30]}, max_captured=32)
    return VerifyCosts(CostCurve.from_samples({8: [0.3]}, max_captured=8), verify)


def _times(host: float, overlapped: bool = True) -> StepTimes:
    times = StepTimes(overlapped)
    times.record(host, 0.0, None)  # a first period without waits sets the host's average to it
    return times


def test_a_host_slower_than_the_device_keeps_the_drafts_the_device_table_alone_would_trim():
    """Survivals 0.73, 0.46, 0.33 per request. The device alone favours 8 drafts (13.8 tokens in 1.77 ms against
    20.2 in 2.60). With 2.2 ms of host work per step overlapping the device's, trimming saves 0.4 ms, not 0.83,
    and every draft is worth it; with the host's work added to the device's, too."""
    survivals = np.tile([0.73, 0.46, 0.33], 8)
    args = (survivals, 8, 8, 8, 1024, 1, _h200_tables_at_8_requests())
    assert choose_budget(*args) == 8
    assert choose_budget(*args, _times(2.2, overlapped=True)) == 24
    assert choose_budget(*args, _times(2.2, overlapped=False)) == 24
    # A host faster than the device changes nothing where the device's part dominates every budget.
    assert choose_budget(*args, _times(1.0, overlapped=True)) == 8


def test_measured_periods_replace_the_tables_for_their_graph_shapes():
    """The same step as the H200's at 8 requests, with no host time of its own, but measured periods: the step
    trimmed to 16 tokens really took 2.28 ms and the untrimmed one (32 tokens) 2.45, so every draft is worth
    it. Budgets that pad to a measured graph (9..16 drafts run in the 24-token graph) take its period too."""
    tables = _h200_tables_at_8_requests()
    survivals = np.tile([0.73, 0.46, 0.33], 8)
    times = StepTimes(True, tables.verify.padded)
    for tokens, period in ((16, 2.28), (32, 2.45)) * 3:  # all waits: no host time of its own
        times.record(period, period, (8, tokens, tokens < 32))  # the trimmed step was re-cut
    assert times.host == 0.0
    assert choose_budget(survivals, 8, 8, 8, 1024, 1, tables, times) == 24
    # The 24-token graph measured cheap: 16 drafts (the first two positions of every request) are the best buy.
    for _ in range(3):
        times.record(1.5, 1.5, (8, 17, True))
    assert choose_budget(survivals, 8, 8, 8, 1024, 1, tables, times) == 16
    # Another number of requests has no periods of its own: the tables decide.
    assert choose_budget(survivals[:21], 7, 7, 7, 1024, 1, tables, times) == \
        choose_budget(survivals[:21], 7, 7, 7, 1024, 1, tables) == 9


def test_a_re_cut_pays_its_own_cost():
    """Two requests of 3 drafts whose last two are doubtful (0.1, 0.05). Dropping the last saves a graph token:
    free, the re-cut would be worth it (5.7 tokens in 1.0 against 5.75 in 1.05). With the re-cut's own cost
    (0.1) on every budget short of the scheduled drafts, every draft is; once re-cut steps in the 7-token graph
    were measured cheap (0.9, re-cut included), that period stands for those budgets, and the step trims."""
    survivals = np.array([0.9, 0.9, 0.9, 0.9, 0.1, 0.05])
    verify = CostCurve.from_samples({4: [1.0], 6: [1.0], 7: [1.0], 8: [1.05]}, max_captured=8)
    free = VerifyCosts(CostCurve.from_samples({2: [0.0]}, 2), verify)
    assert choose_budget(survivals, 2, 2, 2, 1024, 1, free) == 5
    costly = VerifyCosts(CostCurve.from_samples({2: [0.0]}, 2), verify, recut=CostCurve.from_samples({2: [0.1]}, 2))
    assert costly.recut_cost(2) == 0.1 and free.recut_cost(2) == 0.0
    assert choose_budget(survivals, 2, 2, 2, 1024, 1, costly) == 6
    times = StepTimes(True, verify.padded)
    for _ in range(3):
        times.record(1.05, 1.05, (2, 8, False))
    assert choose_budget(survivals, 2, 2, 2, 1024, 1, costly, times) == 6
    for _ in range(3):
        times.record(0.9, 0.9, (2, 7, True))
    assert times.summary_ms() == pytest.approx({"2x8": 1050.0, "2x7 re-cut": 900.0})
    assert choose_budget(survivals, 2, 2, 2, 1024, 1, costly, times) == 5


def test_re_cut_periods_stand_only_for_the_budgets_that_re_cut():
    """Budgets 5 and 6 of 6 drafts pad to the same 8-token graph, measured untrimmed at 1.0 and re-cut at 3.0:
    the untrimmed budget keeps its own period; budget 5 takes the re-cut's; budgets in the unmeasured 4-token
    graph take the table plus the re-cut's cost."""
    verify = CostCurve.from_samples({4: [1.0], 8: [1.0]}, max_captured=8)
    costs = VerifyCosts(CostCurve.from_samples({2: [0.0]}, 2), verify, recut=CostCurve.from_samples({2: [0.5]}, 2))
    times = StepTimes(True, verify.padded)
    for _ in range(3):
        times.record(1.0, 1.0, (2, 8, False))
        times.record(3.0, 3.0, (2, 7, True))
    cost = times.step_costs(costs.step_costs(2, 2, 6), 2, 2)
    cost[:6] += costs.recut_cost(2)
    times.take_recut_periods(cost, 2, 2, 6)
    assert cost.tolist() == [1.5, 1.5, 1.5, 3.0, 3.0, 3.0, 1.0]
    # choose_budget weighs the same costs: with two drafts worth nothing, every draft still wins (6 tokens in
    # 1.0 against 6 in 3.0 at budget 4, or 4 in 1.5 at budget 2).
    assert choose_budget(np.array([1.0] * 4 + [0.0] * 2), 2, 2, 2, 1024, 1, costs, times) == 6


def test_step_times_keep_the_median_of_each_graph_shapes_last_periods():
    curve = CostCurve.from_samples({4: [1.0], 8: [1.0], 16: [1.0], 24: [1.0]}, max_captured=16)
    assert curve.padded(5) == 8 and curve.padded(16) == 16 and curve.padded(20) == 20
    assert curve.padded(np.array([1, 9, 17, 30])).tolist() == [4, 16, 17, 30]
    times = StepTimes(True, curve.padded, smoothing=0.5)
    times.record(2.0, 0.5, None)  # the step waited for was no all-verify step: the host's time only
    assert times.host == 1.5 and times.num_steps == 0
    times.record(4.0, 0.5, (2, 7, False))
    assert times.host == pytest.approx(2.5)  # a moving average: 1.5 + 0.5 * (3.5 - 1.5)
    for period in (100.0, 5.0, 6.0, 7.0, 9.0):  # an outlier, then more periods of the 8-token graph at 2 requests
        times.record(period, period, (2, 8, False))
    assert times.num_steps == 6
    # Budgets 0..5 at 2 requests: 2..7 tokens, graphs 4, 4, 4, 8, 8, 8. The 8-token graph's last PERIOD_SAMPLES
    # periods (of 7 and 8 tokens alike) are 5, 6, 7, 9 and the outlier: their median is 7.
    device = np.full(6, 0.01)
    assert times.step_costs(device, 2, 2).tolist() == [times.host] * 3 + [7.0] * 3  # unmeasured: max(host, device)
    times.record(8.0, 8.0, (2, 8, False))  # the outlier leaves the window
    assert times.step_costs(device, 2, 2)[-1] == 7.0  # the median of 5, 6, 7, 9, 8


def test_a_trimmed_budget_waits_for_a_recent_measurement_of_the_untrimmed_step():
    """Where the tables favour trimming, the untrimmed step (what fixed K runs) is measured first: the hook keeps
    every draft until that shape has MIN_PERIOD_SAMPLES periods, trims while they are recent, and keeps every
    draft once more when REFRESH_STEPS periods have passed without one."""
    from types import SimpleNamespace

    step = SimpleNamespace(scheduled=[SimpleNamespace(request=SimpleNamespace(request_id=r), draft_token_ids=[7] * 3)
                                      for r in ("a", "b")])
    steep = VerifyCosts(CostCurve.from_samples({1: [0.0]}, 1),
                        CostCurve.from_samples({2: [1.0], 3: [1.0], 4: [50.0], 8: [50.0]}, max_captured=8))
    conf = DraftConfidences(3, torch.device("cpu"))
    conf.update(["a", "b"], torch.tensor([[0.9, 0.9, 0.9], [0.9, 0.2, 0.1]]))
    times = StepTimes(False, steep.verify.padded)
    verifier = AdaptiveVerifier(conf, steep, 1024, times)
    full, trimmed = (2, 8, False), (2, 3, True)
    for _ in range(step_times_module.MIN_PERIOD_SAMPLES):
        assert verifier(step, None) is None and verifier.last_budget == 6  # every draft: the untrimmed shape
        times.record(50.0, 49.0, full)
    for _ in range(step_times_module.REFRESH_STEPS):
        assert verifier(step, None) is not None and verifier.last_budget == 1
        times.record(2.0, 1.0, trimmed)
    assert verifier(step, None) is None and verifier.num_refreshed == step_times_module.MIN_PERIOD_SAMPLES + 1
    times.record(50.0, 49.0, full)
    assert verifier(step, None) is not None and verifier.last_budget == 1
    # Without measurements (off CUDA) the tables alone decide, at once.
    assert AdaptiveVerifier(conf, steep, 1024)(step, None) is not None


def test_a_remeasure_in_flight_is_not_asked_for_twice():
    """Under async scheduling a step's period is recorded two steps after its launch, one period late: the step
    after a re-measure does not ask for another while that period is on its way, and asks again if it never
    comes (a step that ended the work is not timed)."""
    times = StepTimes(True)
    assert times.stale(2, 8)
    times.remeasure(2, 8)
    assert not times.stale(2, 8)
    times.record(3.0, 3.0, (2, 3, False))  # the period of the step launched before it
    assert not times.stale(2, 8)
    times.record(8.0, 8.0, (2, 8, False))  # its own
    assert times.stale(2, 8)  # one period of the MIN_PERIOD_SAMPLES wanted
    times.remeasure(2, 8)
    times.record(3.0, 3.0, (2, 3, False))
    times.record(3.0, 3.0, (2, 3, False))
    assert times.stale(2, 8)  # its period did not come


def test_zero_budget_gives_one_token_rows_on_host_and_device():
    assert even_split(0, [3, 3, 2]) == [0, 0, 0]
    caps = device_split(torch.rand(3, 3), torch.tensor([3, 3, 2]), 0)
    assert caps.tolist() == [0, 0, 0]
    cu = np.cumsum([0] + [1 + c for c in even_split(0, [3, 3, 2])])
    assert cu.tolist() == [0, 1, 2, 3]  # exact: every row is its bonus logit only


@pytest.mark.parametrize("seed", range(20))
def test_host_and_device_splits_agree_in_total_and_stay_within_each_row(seed):
    gen = torch.Generator().manual_seed(seed)
    R, K = int(torch.randint(1, 9, (1,), generator=gen)), 7
    drafts = torch.randint(0, K + 1, (R,), generator=gen)
    conf = torch.rand(R, K, generator=gen)
    budget = int(torch.randint(0, int(drafts.sum()) + 1, (1,), generator=gen))
    host, device = even_split(budget, drafts.tolist()), device_split(conf, drafts, budget)
    assert sum(host) == int(device.sum()) == budget
    assert all(0 <= h <= d for h, d in zip(host, drafts.tolist()))
    assert ((device >= 0) & (device <= drafts)).all()
    # The device keeps, per row, the prefix of its most surviving slots: each kept slot outranks each dropped.
    survival = conf.cumprod(1)
    kept = [survival[r, :int(device[r])] for r in range(R)]
    dropped = [survival[r, int(device[r]):int(drafts[r])] for r in range(R)]
    lo = min((k.min() for k in kept if k.numel()), default=torch.tensor(1.0))
    hi = max((d.max() for d in dropped if d.numel()), default=torch.tensor(0.0))
    assert lo >= hi


def test_the_even_split_differs_from_the_survival_split_row_by_row():
    """Two rows of 3 drafts, a budget of 4: the host says [2, 2] (rows 3 and 3 tokens), the device gives the
    confident row 3 drafts ([4, 2] tokens)."""
    conf = torch.tensor([[0.9, 0.9, 0.9], [0.5, 0.1, 0.1]])
    assert even_split(4, [3, 3]) == [2, 2]
    assert device_split(conf, torch.tensor([3, 3]), 4).tolist() == [3, 1]
    with pytest.raises(ValueError, match="exceeds the 6 scheduled drafts"):
        even_split(7, [3, 3])


def test_draft_confidences_rows_follow_the_request_ids():
    """Each request reads the confidences its drafts came with, whether the step keeps the drafting order (the
    table as it stands), reorders or drops requests, or adds one with none yet (1.0)."""
    conf = DraftConfidences(3, torch.device("cpu"))
    host, known = conf.host_rows(["a"])
    assert torch.equal(conf.device_rows(["a"]), torch.ones(1, 3))
    assert np.array_equal(host, np.ones((1, 3))) and known.tolist() == [False]
    table = torch.rand(3, 3, generator=torch.Generator().manual_seed(0))
    conf.update(["a", "b", "c"], table)
    for order, want_known in ((["a", "b", "c"], None), (["c", "a"], [True, True]),
                              (["b", "new", "a"], [True, False, True])):
        host, known = conf.host_rows(order)
        want = torch.stack([table[ord(r) - ord("a")] if r != "new" else torch.ones(3) for r in order])
        assert torch.equal(conf.device_rows(order), want) and np.array_equal(host, want.numpy())
        assert (known if known is None else known.tolist()) == want_known


class _Copy:
    """A device-to-host copy's event that has or has not completed yet."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_the_host_plans_with_the_newest_landed_confidences_and_never_waits():
    """Under async scheduling the next step is planned while the drafter's host copy is on its way: the device
    split reads the newest table, the host budget the newest one that landed (one step stale), as upstream."""
    conf = DraftConfidences(2, torch.device("cpu"))
    old, new = torch.tensor([[0.9, 0.8]]), torch.tensor([[0.2, 0.1]])
    conf.update(["a"], old)
    conf.update(["a"], new)
    index, host, _ = conf._pending[-1]
    copy = _Copy(False)
    conf._pending[-1] = (index, host, copy)  # the newest copy has not landed
    host_rows, _ = conf.host_rows(["a"])
    assert torch.equal(conf.device_rows(["a"]), new) and np.array_equal(host_rows, old.numpy())
    copy.done = True
    host_rows, _ = conf.host_rows(["a"])
    assert np.array_equal(host_rows, new.numpy())


def test_a_budget_that_keeps_every_draft_leaves_the_step_as_scheduled():
    """b* = all drafts needs no re-cut: the hook returns None and queues nothing on the device (it does not even
    read the device table); a smaller budget re-cuts with the same total on both sides."""
    from types import SimpleNamespace

    class HostOnly(DraftConfidences):
        def device_rows(self, request_ids):
            raise AssertionError("a step kept as scheduled read the device table")

    conf = HostOnly(3, torch.device("cpu"))
    conf.update(["a", "b"], torch.tensor([[0.9, 0.9, 0.9], [0.9, 0.2, 0.1]]))
    step = SimpleNamespace(scheduled=[SimpleNamespace(request=SimpleNamespace(request_id=r), draft_token_ids=[7] * 3)
                                      for r in ("a", "b")])
    free = VerifyCosts(CostCurve.from_samples({1: [0.0]}, 1), CostCurve.from_samples({8: [1.0]}, max_captured=8))
    assert AdaptiveVerifier(conf, free, 1024)(step, None) is None
    conf = DraftConfidences(3, torch.device("cpu"))
    conf.update(["a", "b"], torch.tensor([[0.9, 0.9, 0.9], [0.9, 0.2, 0.1]]))
    steep = VerifyCosts(CostCurve.from_samples({1: [0.0]}, 1),
                        CostCurve.from_samples({2: [1.0], 3: [1.0], 4: [50.0], 8: [50.0]}, max_captured=8))
    host, device = AdaptiveVerifier(conf, steep, 1024)(step, None)
    assert sum(host) == int(device.sum()) == 3 and device.tolist() == [2, 1]


def test_step_costs_are_built_once_per_shape_and_match_the_curves():
    """The budget's cost vector is cached per (requests, non-draft tokens, largest budget): the cached vector is
    the curves' sum, and a second step of the same shape gets the same array back."""
    costs = VerifyCosts(CostCurve.from_samples({2: [0.5]}, 2),
                        CostCurve.from_samples({2: [1.0], 4: [2.0], 8: [3.0]}, max_captured=8))
    first = costs.step_costs(2, 2, 6)
    assert np.allclose(first, [1.5, 2.5, 2.5, 3.5, 3.5, 3.5, 3.5])
    assert costs.step_costs(2, 2, 6) is first
    assert costs.step_costs(2, 2, 2) is not first


@pytest.mark.gpu
def test_host_copies_land_in_turn_and_outlive_the_buffer_they_came_from():
    """Each update's table reaches the host through one of two pinned buffers. A landed table is the host's
    own: later updates that write the same buffer do not change what the budget reads."""
    conf = DraftConfidences(2, torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    tables = [torch.rand(3, 2, device="cuda", generator=gen) for _ in range(4)]
    conf.update(["a", "b", "c"], tables[0])
    torch.cuda.synchronize()
    first, _ = conf.host_rows(["a", "b", "c"])
    assert np.array_equal(first, tables[0].cpu().numpy())
    landed = first.copy()
    for table in tables[1:]:
        conf.update(["a", "b", "c"], table)
    assert np.array_equal(first, landed)  # buffers 0 and 1 were written twice since
    torch.cuda.synchronize()
    host, _ = conf.host_rows(["c", "a"])
    assert np.array_equal(host, tables[3].cpu().numpy()[[2, 0]])
    assert torch.equal(conf.device_rows(["c", "a"]), tables[3][[2, 0]])


@pytest.mark.gpu
def test_the_host_copy_reads_the_table_before_the_next_draft_rewrites_it():
    """The copy runs on a stream of its own, behind the drafter's write; the next draft (here a fill behind a
    busy stream) waits for it (before_redraft), so the host reads the table as written."""
    conf = DraftConfidences(2, torch.device("cuda"))
    table = torch.full((3, 2), -1.0, device="cuda")
    want = torch.rand(3, 2, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the step's stream busy for tens of ms: everything below is queued behind it
    table.copy_(want)  # the drafter writes the table
    conf.update(["a", "b", "c"], table)
    conf.before_redraft()
    table.fill_(5.0)  # the next draft rewrites it
    torch.cuda.synchronize()
    host, _ = conf.host_rows(["a", "b", "c"])
    assert np.array_equal(host, want.cpu().numpy())


def test_a_host_bound_step_keeps_every_draft_without_reading_the_confidences():
    """Under async scheduling, when the host's time per step is at least the device's with every draft verified,
    no budget shortens the step: the hook keeps every draft without reading the confidences. Below that, or
    when the host waits for each step (the same 50 then adds to each budget's cost), the budget decides: here it
    trims."""
    from types import SimpleNamespace

    class Unread(DraftConfidences):
        def host_rows(self, request_ids):
            raise AssertionError("a host-bound step read the confidences")

        device_rows = host_rows

    step = SimpleNamespace(scheduled=[SimpleNamespace(request=SimpleNamespace(request_id=r), draft_token_ids=[7] * 3)
                                      for r in ("a", "b")])
    steep = VerifyCosts(CostCurve.from_samples({1: [0.0]}, 1),
                        CostCurve.from_samples({2: [1.0], 3: [1.0], 4: [50.0], 8: [50.0]}, max_captured=8))
    verifier = AdaptiveVerifier(Unread(3, torch.device("cpu")), steep, 1024, _times(50.0))
    assert verifier(step, None) is None
    assert (verifier.last_budget, verifier.num_offered, verifier.num_kept) == (6, 6, 6)
    conf = DraftConfidences(3, torch.device("cpu"))
    conf.update(["a", "b"], torch.tensor([[0.9, 0.9, 0.9], [0.9, 0.2, 0.1]]))
    for host, overlapped in ((1.0, True), (50.0, False)):
        times = StepTimes(overlapped, steep.verify.padded)
        for _ in range(step_times_module.MIN_PERIOD_SAMPLES):  # the untrimmed step, freshly measured
            times.record(host + 50.0, 50.0, (2, 8, False))
        host_lens, device_lens = AdaptiveVerifier(conf, steep, 1024, times)(step, None)
        assert sum(host_lens) == int(device_lens.sum()) < 8


def test_a_step_whose_budgets_all_run_in_one_graph_keeps_every_draft_without_reading_the_confidences():
    """Graphs of 4 and 8 tokens (multiples of 1 + K): one request's budgets 0-3 run 1-4 tokens, all in the 4-token
    graph, so a trim shortens nothing (it would only add its re-cut). The hook keeps every draft without reading
    the confidences, and can_trim tells the runner the host copy is not needed. Two requests' 2-8 tokens can run
    in the 4-token graph instead of the 8-token one: the budget is asked, and under these costs trims."""
    class Unread(DraftConfidences):
        def host_rows(self, request_ids):
            raise AssertionError("a step whose budgets all run in one graph read the confidences")

        device_rows = host_rows

    steep = VerifyCosts(_flat_draft(), CostCurve.from_samples({4: [1.0], 8: [50.0]}, max_captured=8))
    verifier = AdaptiveVerifier(Unread(3, torch.device("cpu")), steep, 1024)
    assert not verifier.can_trim(1, 3) and verifier.can_trim(2, 6) and verifier.can_trim(1, 9)  # 10 > 8: eager
    assert verifier(_step("a"), None) is None and verifier.take_prediction() is None
    assert (verifier.last_budget, verifier.num_offered, verifier.num_kept) == (3, 3, 3)
    conf = DraftConfidences(3, torch.device("cpu"))
    conf.update(["a", "b"], torch.tensor([[0.9, 0.9, 0.9], [0.9, 0.2, 0.1]]))
    host_lens, device_lens = AdaptiveVerifier(conf, steep, 1024)(_step("a", "b"), None)
    assert sum(host_lens) == int(device_lens.sum()) == 4


def test_a_table_no_budget_reads_reaches_the_device_split_but_not_the_host():
    """update(to_host=False): the device table and its rows move on (a re-cut reads them), the host keeps the
    newest table that was copied."""
    conf = DraftConfidences(2, torch.device("cpu"))
    old, new = torch.tensor([[0.9, 0.8]]), torch.tensor([[0.3, 0.2], [0.7, 0.6]])
    conf.update(["a"], old)
    conf.update(["b", "a"], new, to_host=False)
    host, known = conf.host_rows(["a", "b"])
    assert np.array_equal(host, np.array([[0.9, 0.8], [1.0, 1.0]], dtype=np.float32))
    assert known.tolist() == [True, False]
    assert torch.equal(conf.device_rows(["a", "b"]), new[[1, 0]])


def _step(*request_ids: str, drafts: int = 3):
    from types import SimpleNamespace
    return SimpleNamespace(scheduled=[SimpleNamespace(request=SimpleNamespace(request_id=r),
                                                      draft_token_ids=[7] * drafts) for r in request_ids])


def _prediction(survivals: np.ndarray) -> SurvivalPrediction:
    """Every slot of every row verified, every row known to the host."""
    return SurvivalPrediction(survivals, None, None)


def test_calibration_scales_each_position_by_what_was_accepted_against_what_was_predicted():
    """Per position, observed over predicted survival, shrunk towards 1 by the prior; calibrated survivals stay
    at most 1 and never rise along a row."""
    cal = SurvivalCalibration(3)
    assert cal.scale.tolist() == [1.0, 1.0, 1.0]
    # 100 rows predicted 0.5, 0.25, 0.125 per position; 70 accepted >= 1 draft, 45 >= 2, 30 all 3.
    accepted = np.array([3] * 30 + [2] * 15 + [1] * 25 + [0] * 30)
    cal.observe(_prediction(np.tile([0.5, 0.25, 0.125], (100, 1))), accepted.tolist())
    cal.fold()  # (outcomes queue until CALIBRATION_BATCH_ROWS rows)
    keep = (1 - 1 / calibration_module.CALIBRATION_ROWS) ** 100
    prior = calibration_module.CALIBRATION_PRIOR
    assert cal.scale == pytest.approx([(70 + prior) / (50 + prior), (45 + prior) / (25 + prior),
                                       (30 + prior) / (12.5 + prior)])
    assert cal.num_rows == 100
    calibrated = cal.apply(np.array([[0.9, 0.6, 0.1], [0.5, 0.25, 0.125]]))
    assert calibrated[0].tolist() == [1.0, 1.0, pytest.approx(0.1 * cal.scale[2])]  # capped at 1
    assert calibrated[1] == pytest.approx([0.5 * cal.scale[0], min(0.5 * cal.scale[0], 0.25 * cal.scale[1]),
                                           min(0.5 * cal.scale[0], 0.25 * cal.scale[1], 0.125 * cal.scale[2])])
    assert (np.diff(calibrated, axis=1) <= 0).all()
    # Older rows fade: a second batch of rows that accept nothing pulls the ratios down, the old ones weighed less.
    cal.observe(_prediction(np.tile([0.5, 0.25, 0.125], (100, 1))), [0] * 100)
    cal.fold()
    assert cal.scale[0] == pytest.approx((70 * keep + prior) / (50 * keep + 50 + prior))
    # Only the rows the host had confidences for count, and only their verified slots.
    cal = SurvivalCalibration(2)
    prediction = SurvivalPrediction(np.array([[0.5, 0.25], [0.8, 0.4], [0.6, 0.3]]), np.array([True, False, True]),
                                    np.array([2, 2, 1]))
    cal.observe(prediction, [2, 1, 0])
    assert cal.num_rows == 0 and cal.version == 0  # queued: fewer than CALIBRATION_BATCH_ROWS rows
    cal.fold()
    # ... and folded by themselves once that many rows have come (of which 2 in 3 count).
    steps = -(-calibration_module.CALIBRATION_BATCH_ROWS // 3)
    for _ in range(steps):
        assert cal.version == 1
        cal.observe(prediction, [2, 1, 0])
    assert cal.version == 2 and cal.num_rows == 2 + 2 * steps
    cal = SurvivalCalibration(2)
    cal.observe(prediction, [2, 1, 0])
    cal.fold()
    assert cal.predicted.tolist() == [1.1, 0.25] and cal.observed.tolist() == [1.0, 1.0] and cal.num_rows == 2


def test_every_step_that_read_survivals_leaves_its_prediction_once():
    conf = DraftConfidences(3, torch.device("cpu"))
    conf.update(["a", "b"], torch.tensor([[0.9, 0.8, 0.5], [0.6, 0.5, 0.4]]))
    # (A trimmed step could run in the 2-token graph, at the same cost: the budget is asked, and keeps all.)
    free = VerifyCosts(CostCurve.from_samples({1: [0.0]}, 1),
                       CostCurve.from_samples({2: [1.0], 8: [1.0]}, max_captured=8))
    verifier = AdaptiveVerifier(conf, free, 1024)
    assert verifier(_step("a", "b", "new"), None) is None
    prediction = verifier.take_prediction()
    # The raw running products, summed over the rows the host has confidences for ("new" reads 1.0: not counted).
    assert prediction.known.tolist() == [True, True, False] and prediction.verified() is None
    assert prediction.survivals[:2] == pytest.approx(np.array([[0.9, 0.72, 0.36], [0.6, 0.3, 0.12]]))
    assert verifier.take_prediction() is None
    # Rows with fewer drafts verify only those.
    step = _step("a", "b")
    step.scheduled[1].draft_token_ids = [7]
    verifier(step, None)
    assert verifier.take_prediction().verified().tolist() == [3, 1]
    # A re-cut step leaves one too: the runner adds the rows' device lengths, which say what was verified.
    steep = VerifyCosts(CostCurve.from_samples({1: [0.0]}, 1),
                        CostCurve.from_samples({2: [1.0], 3: [1.0], 4: [50.0], 8: [50.0]}, max_captured=8))
    trimming = AdaptiveVerifier(conf, steep, 1024)
    _, device_lens = trimming(_step("a", "b"), None)
    prediction = trimming.take_prediction()
    prediction.device_lens = device_lens
    assert prediction.verified().tolist() == (device_lens - 1).tolist() == [1, 0]


def test_a_re_cut_step_calibrates_only_the_slots_it_verified():
    """Device caps [2, 1, 0]: row 0 accepted both its verified drafts, row 1 none, row 2 had none verified. Slots
    past a row's cap are left out, also row 1's, whose fate is known (it failed before them): counting those
    only where a row failed early would lower the ratios past the cap."""
    cal = SurvivalCalibration(3)
    survivals = np.array([[0.8, 0.4, 0.2], [0.6, 0.3, 0.15], [0.5, 0.25, 0.1]])
    cal.observe(SurvivalPrediction(survivals, None, None, device_lens=torch.tensor([3, 2, 1], dtype=torch.int32)),
                [2, 0, 0])
    cal.fold()
    assert cal.predicted.tolist() == pytest.approx([0.8 + 0.6, 0.4, 0.0])
    assert cal.observed.tolist() == [1, 1, 0] and cal.num_rows == 3


def test_calibration_from_re_cut_steps_finds_the_heads_bias(monkeypatch):
    """Every position accepted at 1.5x the head's confidence, each row verified up to a cap chosen by its
    confidences (as the device's top-b* does): the ratios find 1.5, 1.5^2 and 1.5^3, though most rows are capped
    before the last position. Counting the slots past a cap where the row failed before it would not."""
    monkeypatch.setattr(calibration_module, "CALIBRATION_ROWS", float("inf"))  # every row counts: sampling noise alone
    rng = np.random.default_rng(0)
    cal = SurvivalCalibration(3)
    for _ in range(40):
        conf = rng.uniform(0.2, 0.6, (128, 3))
        survivals = conf.cumprod(axis=1)
        accepted = (rng.random((128, 3)) < 1.5 * conf).cumprod(axis=1).sum(1)
        caps = (survivals > 0.1).sum(1)  # a confident row keeps more of its drafts
        cal.observe(SurvivalPrediction(survivals, None, None, device_lens=torch.from_numpy(1 + caps)),
                    np.minimum(accepted, caps).tolist())
    cal.fold()
    assert cal.scale == pytest.approx([1.5, 1.5 ** 2, 1.5 ** 3], rel=0.1)


def test_calibrated_survivals_keep_every_draft_where_the_heads_own_would_trim():
    """The H200 case at 8 requests (ef6826c): measured periods of 1.93 ms for the step trimmed to 16 tokens and
    2.60 untrimmed (32 tokens). The head's survivals, about 0.54, 0.26, 0.13 per position, favour trimming to
    the first drafts (12.3 tokens in 1.93 ms against 15.4 in 2.60); greedy serving accepts 0.73, 0.46, 0.33,
    and once the calibration has seen that, every draft is worth its step (20.2 tokens against 13.8)."""
    rids = [str(i) for i in range(8)]
    conf = DraftConfidences(3, torch.device("cpu"))
    conf.update(rids, torch.tensor([[0.54, 0.49, 0.48]]).repeat(8, 1))
    tables = _h200_tables_at_8_requests()
    times = StepTimes(True, tables.verify.padded)
    for tokens, period in ((16, 1.93), (32, 2.60)) * 3:
        times.record(period, period, (8, tokens, tokens < 32))
    verifier = AdaptiveVerifier(conf, tables, 1024, times)
    assert verifier(_step(*rids), None) is not None and verifier.last_budget == 8
    # Untrimmed steps (re-measures) seen: of 100 rows, 73 accepted >= 1 draft, 46 >= 2, 33 all three.
    accepted = np.array([3] * 33 + [2] * 13 + [1] * 27 + [0] * 27)
    verifier.observe(_prediction(np.tile(np.cumprod([0.54, 0.49, 0.48]), (100, 1))), accepted.tolist())
    verifier.calibration.fold()
    assert verifier(_step(*rids), None) is None and verifier.last_budget == 24


def test_the_device_split_ranks_slots_by_calibrated_survival():
    """Row a's second draft (0.9 * 0.5 = 0.45) against row b's first (0.5): raw, b's wins; with the second
    position's survivals found twice as likely as predicted, a's (0.9) does. Calibrated survivals are capped and
    never rise along a row, so each row still keeps a prefix."""
    confidence = torch.tensor([[0.9, 0.5], [0.5, 0.1]])
    drafts = torch.tensor([2, 2])
    assert device_split(confidence, drafts, 2).tolist() == [1, 1]
    assert device_split(confidence, drafts, 2, torch.tensor([1.0, 2.0])).tolist() == [2, 0]
    assert device_split(confidence, drafts, 3, torch.tensor([1.0, 2.0])).tolist() == [2, 1]
    # Scaled survivals that would rise along a row (0.5, then 0.45 * 3) count as the row's first slot's (0.5):
    # the one slot goes to the other row's first (0.8), not to a second slot without its first.
    rising = torch.tensor([[0.5, 0.9], [0.8, 0.1]])
    assert device_split(rising, drafts, 1, torch.tensor([1.0, 3.0])).tolist() == [0, 1]
