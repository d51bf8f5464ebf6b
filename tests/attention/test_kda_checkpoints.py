"""KDA checkpoint columns under speculative decoding, on the torch reference backend (CPU).

A request holds 1 + K state slots (columns). A decode row reads its initial conv and ssm state from column
num_accepted_tokens - 1 and writes the state after its token t to column t, so rejecting drafts needs no undo:
the next step just reads an earlier column. Checked against the plain (1-D, one slot) path run from a copy of
the column read, on both of the backend's decode paths (batched one-token rows, per-request rows); then the
metadata builder's split of 2-D columns into decode and prefill groups; then a mixed step and a two-step
sequence where most drafts are rejected.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from kda_harness import Row, common_metadata, random_inputs, random_layer, random_pools

from vllm.attention.kda.metadata import KDAAttention, KDAMetadataBuilder, KDARows
from vllm.attention.kda.torch_ref import TorchKDABackend

H, D, W = 2, 8, 4  # heads, head dim, conv width: small, so the float64 runs stay quick
K = 3  # drafts per verify row: 1 + K columns per request
SLOTS = 40  # pool size: the columns are scattered over it, the rest belong to nobody in the step
STATE_TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.float64: {"rtol": 1e-10, "atol": 1e-10}}
# Outputs: the gated norm takes its gate and weight in float32 even in a float64 run, and torch's vectorised and
# scalar float32 sigmoid differ in the last bit, so batch shape alone moves an output by ~1 float32 ulp.
OUT_TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.float64: {"rtol": 1e-6, "atol": 1e-6}}
DTYPES = [torch.float32, torch.float64]
GATES = [None, -5.0]  # Kimi-Linear's softplus gate, K3's bounded one


def make_layer(dtype: torch.dtype, lower_bound: float | None, gen: torch.Generator):
    layer = random_layer(H, D, W, lower_bound, "cpu", gen)
    if dtype == torch.float32:
        return layer
    out = copy.copy(layer)  # the harness builds float32 weights; a float64 run needs float64 weights too
    out.conv_weight, out.A_log, out.dt_bias = (x.to(dtype) for x in (layer.conv_weight, layer.A_log, layer.dt_bias))
    out.o_norm = copy.deepcopy(layer.o_norm).to(dtype)
    return out


def make_case(dtype: torch.dtype, lower_bound: float | None, seed: int):
    """A random layer and pools where every slot holds its own random conv and ssm state (none zero)."""
    gen = torch.Generator().manual_seed(seed)
    layer = make_layer(dtype, lower_bound, gen)
    pools = random_pools(layer, SLOTS, W, dtype, dtype, "cpu", gen)
    return layer, pools, gen


def scattered_columns(n_reqs: int, gen: torch.Generator) -> list[list[int]]:
    """1 + K distinct non-null slots per request, in random order (not contiguous, not ascending)."""
    perm = torch.randperm(SLOTS - 1, generator=gen)[:n_reqs * (1 + K)] + 1
    return perm.view(n_reqs, 1 + K).tolist()


def decode_rows(lens: list[int], slots, accepted: list[int] | None = None) -> KDARows:
    """Decode rows by hand: 1-D `slots` for the plain path, 2-D columns plus `accepted` for checkpoints."""
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(lens).cumsum(0)
    idx = torch.tensor(slots, dtype=torch.int32)
    has_init = torch.ones(len(lens), dtype=torch.bool)
    return KDARows(query_start_loc=qsl, query_start_loc_cpu=qsl, state_indices=idx, state_indices_cpu=idx,
                   has_initial_state=has_init, has_initial_state_cpu=has_init, num_reqs=len(lens),
                   num_tokens=sum(lens), max_query_len=max(lens),
                   num_accepted_tokens=None if accepted is None else torch.tensor(accepted, dtype=torch.int32))


def starts_of(lens: list[int]) -> list[int]:
    return [sum(lens[:r]) for r in range(len(lens))]


def plain(layer, inputs, conv_state: torch.Tensor, ssm_state: torch.Tensor):
    """One request through the plain 1-D decode path from the given states, copied into a one-slot scratch pool.
    Returns (output, conv state after, ssm state after)."""
    conv, ssm = conv_state[None].clone(), ssm_state[None].clone()
    out = TorchKDABackend.forward_decode(layer, *inputs, conv, ssm, decode_rows([inputs[0].shape[0]], [0]))
    return out, conv[0], ssm[0]


def tokens(inputs, start: int, n: int):
    return tuple(x[start:start + n] for x in inputs)


def assert_untouched(pools, before, written: set[int]) -> None:
    """Every slot outside `written` (other requests, unused columns, columns only read) is bit-identical."""
    keep = [i for i in range(SLOTS) if i not in written]
    for got, want in zip(pools, before):
        assert torch.equal(got[keep], want[keep])


def check_checkpoint_step(layer, inputs, pools, lens, cols, accepted, out, before) -> None:
    """`out` and `pools` after a checkpointed decode step against the plain path from column accepted - 1:
    the row's output, column t = the state after token t, and nothing else written."""
    conv0, ssm0 = before
    tol = STATE_TOL[ssm0.dtype]
    written = set()
    for r, start in enumerate(starts_of(lens)):
        n, c, src = lens[r], cols[r], cols[r][accepted[r] - 1]
        want, _, _ = plain(layer, tokens(inputs, start, n), conv0[src], ssm0[src])
        torch.testing.assert_close(out[start:start + n], want, **OUT_TOL[ssm0.dtype])
        for t in range(n):
            _, want_conv, want_ssm = plain(layer, tokens(inputs, start, t + 1), conv0[src], ssm0[src])
            torch.testing.assert_close(pools[0][c[t]], want_conv, **tol)
            torch.testing.assert_close(pools[1][c[t]], want_ssm, **tol)
        written |= set(c[:n])
    assert_untouched(pools, before, written)


def run_checkpointed(layer, inputs, pools, lens, cols, accepted):
    """The checkpointed decode path on copies of the pools: (output, (conv, ssm) after)."""
    conv, ssm = (p.clone() for p in pools)
    out = TorchKDABackend.forward_decode(layer, *inputs, conv, ssm, decode_rows(lens, cols, accepted))
    return out, (conv, ssm)


def forbid(monkeypatch, name: str) -> None:
    """Make one of the backend's two decode paths raise, to prove a test runs the other one."""
    def fail(*args, **kwargs):
        raise AssertionError(f"TorchKDABackend.{name} ran")
    monkeypatch.setattr(TorchKDABackend, name, staticmethod(fail))


# --- the backend's two decode paths ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("lower_bound", GATES, ids=["softplus", "bounded"])
def test_ragged_rows_read_column_accepted_minus_one_and_write_each_token(dtype, lower_bound, monkeypatch):
    # Lengths 1..K+1 with accepted counts 1..K+1: a row reading a column past its own length (2 tokens from
    # column 2), one overwriting the column it reads (4 tokens from column 1), a 1-token row on this path.
    lens, accepted = [2, 4, 1, 3, 4, 2], [3, 2, 4, 1, 4, 1]
    layer, pools, gen = make_case(dtype, lower_bound, seed=1)
    cols = scattered_columns(len(lens), gen)
    inputs = random_inputs(layer, sum(lens), dtype, "cpu", gen)
    with monkeypatch.context() as m:
        forbid(m, "_one_token_rows")
        out, after = run_checkpointed(layer, inputs, pools, lens, cols, accepted)
    check_checkpoint_step(layer, inputs, after, lens, cols, accepted, out, pools)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("lower_bound", GATES, ids=["softplus", "bounded"])
def test_one_token_rows_read_column_accepted_minus_one_and_write_column_zero(dtype, lower_bound, monkeypatch):
    accepted = [1, 2, 3, K + 1, 2, 4, 1]
    lens = [1] * len(accepted)
    layer, pools, gen = make_case(dtype, lower_bound, seed=2)
    cols = scattered_columns(len(lens), gen)
    inputs = random_inputs(layer, len(lens), dtype, "cpu", gen)
    with monkeypatch.context() as m:
        forbid(m, "_per_request")  # the batched step, not the per-request loop
        out, after = run_checkpointed(layer, inputs, pools, lens, cols, accepted)
    check_checkpoint_step(layer, inputs, after, lens, cols, accepted, out, pools)


def test_reading_another_column_changes_the_result():
    # Guards the checks above: the columns really differ, so a backend reading the wrong one would be caught.
    layer, pools, gen = make_case(torch.float64, -5.0, seed=3)
    cols = scattered_columns(1, gen)
    inputs = random_inputs(layer, 3, torch.float64, "cpu", gen)
    outs = [run_checkpointed(layer, inputs, pools, [3], cols, [a])[0] for a in range(1, K + 2)]
    for a in range(1, K + 1):
        assert (outs[a] - outs[0]).abs().max() > 1e-3


# --- the metadata builder ----------------------------------------------------------------------------------


def spec_common(rows: list[Row], cols: list[list[int]], accepted: list[int]):
    """The runner's metadata under speculative decoding: 2-D columns, num_accepted and row tags."""
    common = common_metadata(rows, "cpu")
    idx = torch.tensor(cols, dtype=torch.int32)
    tags = torch.tensor([-1 if r.prefilling else r.num_tokens - 1 for r in rows], dtype=torch.int32)
    return dataclasses.replace(common, state_indices=idx, state_indices_cpu=idx, num_draft_tokens=tags,
                               num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32))


def builder() -> KDAMetadataBuilder:
    return KDAMetadataBuilder(TorchKDABackend)


COLS = [[5, 9, 2, 30], [11, 3, 17, 8], [21, 14, 6, 33], [25, 1, 19, 12], [7, 28, 16, 24]]
# A mixed step: decode rows of 3, 1 and 4 tokens (one a padded tail's shape) around two prompt chunks.
MIXED = [Row(3, 12, False, 5), Row(5, 7, True, 11), Row(1, 40, False, 21), Row(4, 0, True, 25), Row(4, 9, False, 7)]
MIXED_ACCEPTED = [2, 1, 4, 1, 1]


@pytest.mark.parametrize("lens,accepted", [([2, 1, 4], [2, 1, 4]), ([1, 1, 1], [3, 1, 2])],
                         ids=["drafts", "no_drafts"])
def test_builder_all_decode_step_keeps_the_columns(lens, accepted):
    # Rows without drafts too take the checkpointed path: a graph captured on 1-token rows replays ragged ones.
    rows = [Row(n, 10 + n, False, c[0]) for n, c in zip(lens, COLS)]
    common = spec_common(rows, COLS[:3], accepted)
    meta = builder().build(common)
    assert meta.prefill is None and meta.num_tokens == sum(lens)
    d = meta.decode
    assert d.checkpointed and d.token_idx is None and d.num_reqs == 3 and d.num_tokens == sum(lens)
    assert d.state_indices.tolist() == COLS[:3] and d.state_indices_cpu.tolist() == COLS[:3]
    assert d.num_accepted_tokens.tolist() == accepted
    assert d.query_start_loc_cpu.tolist() == [0] + torch.tensor(lens).cumsum(0).tolist()
    assert d.has_initial_state_cpu.tolist() == [True] * 3


def test_builder_mixed_step_splits_columns_and_accepted_by_request_state():
    meta = builder().build(spec_common(MIXED, COLS, MIXED_ACCEPTED))
    d, p = meta.decode, meta.prefill
    assert d.checkpointed and d.state_indices_cpu.tolist() == [COLS[0], COLS[2], COLS[4]]
    assert d.state_indices.tolist() == [COLS[0], COLS[2], COLS[4]]
    assert d.num_accepted_tokens.tolist() == [2, 4, 1]  # gathered for the decode rows, not the first three
    assert d.query_start_loc_cpu.tolist() == [0, 3, 4, 8] and d.max_query_len == 4
    assert d.token_idx.tolist() == [0, 1, 2, 8, 13, 14, 15, 16]
    # Prompt chunks read and write column 0 only, as the plain 1-D path.
    assert not p.checkpointed and p.num_accepted_tokens is None
    assert p.state_indices_cpu.tolist() == [COLS[1][0], COLS[3][0]] and p.state_indices.tolist() == [11, 25]
    assert p.token_idx.tolist() == [3, 4, 5, 6, 7, 9, 10, 11, 12]
    assert p.has_initial_state_cpu.tolist() == [True, False]
    assert meta.num_tokens == 17


def test_builder_all_prefill_step_uses_column_zero():
    rows = [Row(6, 0, True, 5), Row(3, 8, True, 11)]
    meta = builder().build(spec_common(rows, COLS[:2], [1, 1]))
    assert meta.decode is None
    p = meta.prefill
    assert not p.checkpointed and p.num_accepted_tokens is None and p.state_indices_cpu.tolist() == [5, 11]


@pytest.mark.parametrize("rows", [[Row(2, 9, False, 4), Row(1, 3, False, 8)], MIXED], ids=["decode", "mixed"])
def test_builder_one_slot_per_request_keeps_the_plain_layout(rows):
    # One slot per request has no columns to choose from: accepted counts, even if present, are not passed on.
    common = dataclasses.replace(common_metadata(rows, "cpu"),
                                 num_accepted_tokens=torch.full((len(rows),), 2, dtype=torch.int32))
    meta = builder().build(common)
    for group, prefilling in ((meta.decode, False), (meta.prefill, True)):
        if group is None:
            continue
        assert not group.checkpointed and group.num_accepted_tokens is None
        assert group.state_indices_cpu.tolist() == [r.slot for r in rows if r.prefilling == prefilling]


# --- whole steps through the backend pair ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
def test_mixed_step_checkpoints_decode_rows_and_keeps_prefill_on_column_zero(dtype):
    layer, pools, gen = make_case(dtype, -5.0, seed=4)
    inputs = random_inputs(layer, sum(r.num_tokens for r in MIXED), dtype, "cpu", gen)
    attn = KDAAttention(TorchKDABackend, TorchKDABackend)
    conv, ssm = (p.clone() for p in pools)
    with torch.inference_mode():
        out = attn.forward(layer, *inputs, conv, ssm, attn.builder(16).build(spec_common(MIXED, COLS,
                                                                                         MIXED_ACCEPTED)))
    tol = STATE_TOL[dtype]
    written = set()
    for r, start in enumerate(starts_of([row.num_tokens for row in MIXED])):
        row, c, n = MIXED[r], COLS[r], MIXED[r].num_tokens
        if row.prefilling:
            # The plain 1-D prefill of this chunk alone from column 0 (zero state for a fresh prompt).
            ref_pools = tuple(p.clone() for p in pools)
            assert row.slot == c[0]  # so the 1-D reference step runs on the chunk's column 0
            ref = attn.forward(layer, *tokens(inputs, start, n), *ref_pools,
                               attn.builder(16).build(common_metadata([row], "cpu")))
            torch.testing.assert_close(out[start:start + n], ref, **OUT_TOL[dtype])
            torch.testing.assert_close(conv[c[0]], ref_pools[0][c[0]], **tol)
            torch.testing.assert_close(ssm[c[0]], ref_pools[1][c[0]], **tol)
            written.add(c[0])
            continue
        src = c[MIXED_ACCEPTED[r] - 1]
        want, want_conv, want_ssm = plain(layer, tokens(inputs, start, n), pools[0][src], pools[1][src])
        torch.testing.assert_close(out[start:start + n], want, **OUT_TOL[dtype])
        torch.testing.assert_close(conv[c[n - 1]], want_conv, **tol)
        torch.testing.assert_close(ssm[c[n - 1]], want_ssm, **tol)
        written |= set(c[:n])
    assert_untouched((conv, ssm), pools, written)


def run_decode_step(attn: KDAAttention, layer, inputs, pools, lens, cols, accepted):
    """One all-decode step through the builder and the pair, updating `pools` in place."""
    rows = [Row(n, 20, False, c[0]) for n, c in zip(lens, cols)]
    with torch.inference_mode():
        return attn.forward(layer, *inputs, *pools, attn.builder(16).build(spec_common(rows, cols, accepted)))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("next_lens", [[4, 1, 2], [1, 1, 1]], ids=["ragged", "one_token"])
def test_next_step_continues_from_the_accepted_tokens_only(dtype, next_lens):
    # Step 1 verifies K drafts per request; A keeps 1 of them, B all, C none. Step 2 reads column kept - 1 and
    # must match one plain pass over the history's accepted tokens then step 2's tokens: the rejected drafts,
    # computed and checkpointed in step 1, leave no trace.
    kept, prior_accepted = [2, K + 1, 1], [1, 3, 2]
    layer, pools, gen = make_case(dtype, None, seed=5)
    cols = scattered_columns(3, gen)
    before = tuple(p.clone() for p in pools)
    attn = KDAAttention(TorchKDABackend, TorchKDABackend)
    step1 = random_inputs(layer, 3 * (1 + K), dtype, "cpu", gen)
    run_decode_step(attn, layer, step1, pools, [1 + K] * 3, cols, prior_accepted)
    step2 = random_inputs(layer, sum(next_lens), dtype, "cpu", gen)
    out = run_decode_step(attn, layer, step2, pools, next_lens, cols, kept)
    tol = STATE_TOL[dtype]
    for r, (start1, start2) in enumerate(zip(starts_of([1 + K] * 3), starts_of(next_lens))):
        src, n = cols[r][prior_accepted[r] - 1], next_lens[r]
        seq = tuple(torch.cat([a, b]) for a, b in zip(tokens(step1, start1, kept[r]), tokens(step2, start2, n)))
        for t in range(n):
            want, want_conv, want_ssm = plain(layer, tuple(x[:kept[r] + t + 1] for x in seq), before[0][src],
                                              before[1][src])
            torch.testing.assert_close(out[start2 + t], want[-1], **OUT_TOL[dtype])
            torch.testing.assert_close(pools[0][cols[r][t]], want_conv, **tol)
            torch.testing.assert_close(pools[1][cols[r][t]], want_ssm, **tol)
