"""Graph bookkeeping: capture sizes, descriptors, mode downgrades, dispatch; one capture/replay on the GPU."""
from __future__ import annotations

import pytest
import torch

from vllm.attention.backend import AttentionCGSupport as S
from vllm.config import CompilationConfig
from vllm.worker.cudagraph import (
    BatchDescriptor,
    CudaGraphDispatcher,
    CUDAGraphMode,
    CUDAGraphRunner,
    capture_descriptors,
    capture_sizes,
    resolve_mode,
)

M = CUDAGraphMode


def test_capture_sizes_default():
    cfg = CompilationConfig(max_cudagraph_capture_size=40)
    assert capture_sizes(cfg, max_num_seqs=256, max_num_batched_tokens=8192, num_speculative_tokens=0) == [
        1, 2, 4, 8, 16, 24, 32, 40]
    small = CompilationConfig(max_cudagraph_capture_size=3)
    assert capture_sizes(small, 256, 8192, 0) == [1, 2]


def test_capture_sizes_explicit():
    cfg = CompilationConfig(cudagraph_capture_sizes=[5, 3, 5, 100])
    assert capture_sizes(cfg, 256, 8192, 0) == [3, 5, 100]


def test_capture_sizes_rounded_to_verify_rows():
    cfg = CompilationConfig(cudagraph_capture_sizes=[1, 2, 4, 5, 8, 9, 16])
    # K=3: rows of 4 tokens; 1, 2, 4 all become 4, 5 and 8 become 8.
    assert capture_sizes(cfg, 256, 8192, 3) == [4, 8, 12, 16]


def test_capture_sizes_drop_too_large():
    cfg = CompilationConfig(cudagraph_capture_sizes=[1, 2, 4, 8, 16, 24, 32])
    assert capture_sizes(cfg, max_num_seqs=4, max_num_batched_tokens=8192, num_speculative_tokens=0) == [1, 2, 4]
    assert capture_sizes(cfg, max_num_seqs=4, max_num_batched_tokens=8192, num_speculative_tokens=3) == [4, 8, 16]
    assert capture_sizes(cfg, max_num_seqs=256, max_num_batched_tokens=10, num_speculative_tokens=0) == [1, 2, 4, 8]


def test_capture_descriptors_none():
    assert capture_descriptors([1, 2, 4], 2, 0, M.NONE) == []
    assert capture_descriptors([4, 8], 2, 3, M.NONE) == []


def test_capture_descriptors_decode_only():
    assert capture_descriptors([1, 2, 4], 2, 0, M.FULL_DECODE_ONLY) == [
        BatchDescriptor(1, 1, 1, 1), BatchDescriptor(2, 2, 1, 1), BatchDescriptor(4, 2, 1, 1)]
    assert capture_descriptors([4, 8], 4, 3, M.FULL_DECODE_ONLY) == [
        BatchDescriptor(4, 4, 4, None), BatchDescriptor(8, 4, 4, None)]


def test_capture_descriptors_full():
    assert capture_descriptors([1, 4], 2, 0, M.FULL) == [
        BatchDescriptor(1, 1, 1, 1), BatchDescriptor(4, 2, 1, 1),
        BatchDescriptor(1, 1, None, None), BatchDescriptor(4, 2, None, None)]
    assert capture_descriptors([4, 8], 4, 3, M.FULL) == [
        BatchDescriptor(4, 4, 4, None), BatchDescriptor(8, 4, 4, None),
        BatchDescriptor(4, 4, None, None), BatchDescriptor(8, 4, None, None)]


@pytest.mark.parametrize("requested, support, k, expected, downgraded", [
    (M.NONE, S.ALWAYS, 0, M.NONE, False),
    (M.FULL, S.ALWAYS, 3, M.FULL, False),
    (M.FULL, S.UNIFORM_BATCH, 0, M.FULL_DECODE_ONLY, True),
    (M.FULL, S.UNIFORM_BATCH, 3, M.NONE, True),
    (M.FULL, S.NEVER, 0, M.NONE, True),
    (M.FULL_DECODE_ONLY, S.ALWAYS, 3, M.FULL_DECODE_ONLY, False),
    (M.FULL_DECODE_ONLY, S.UNIFORM_BATCH, 3, M.NONE, True),
    (M.FULL_DECODE_ONLY, S.UNIFORM_SINGLE_TOKEN_DECODE, 0, M.FULL_DECODE_ONLY, False),
    (M.FULL_DECODE_ONLY, S.NEVER, 0, M.NONE, True),
    # Decode-only varlen backends (the KDA pair): FULL keeps its decode graphs, verify graphs replay.
    (M.FULL, S.VARLEN_DECODE, 3, M.FULL_DECODE_ONLY, True),
    (M.FULL_DECODE_ONLY, S.VARLEN_DECODE, 3, M.FULL_DECODE_ONLY, False),
    (M.FULL_AND_PIECEWISE, S.VARLEN_DECODE, 3, M.FULL_AND_PIECEWISE, False),
])
def test_resolve_mode(requested, support, k, expected, downgraded):
    mode, reason = resolve_mode(requested, support, k)
    assert mode is expected
    if downgraded:
        assert reason and support.name in reason
    else:
        assert reason is None


def test_dispatch_prefill_only_in_mixed_graph():
    decode = [BatchDescriptor(8, 8, 1, 1), BatchDescriptor(16, 16, 4, None)]
    assert CudaGraphDispatcher(decode).dispatch(6, 2, None, None) is None
    mixed = BatchDescriptor(16, 16, None, None)
    assert CudaGraphDispatcher(decode + [mixed]).dispatch(6, 2, None, None) == mixed


def test_dispatch_smallest_compatible():
    descs = [BatchDescriptor(n, n, 1, 1) for n in (16, 1, 4, 8, 2)]
    d = CudaGraphDispatcher(descs)
    assert d.dispatch(3, 3, 1, 1) == BatchDescriptor(4, 4, 1, 1)
    assert d.dispatch(8, 8, 1, 1) == BatchDescriptor(8, 8, 1, 1)
    assert d.dispatch(17, 1, 1, 1) is None and CudaGraphDispatcher([]).dispatch(1, 1, 1, 1) is None


def test_dispatch_prefers_uniform_then_bounded():
    uniform, varlen, mixed = BatchDescriptor(16, 4, 4, 4), BatchDescriptor(8, 8, 4, None), BatchDescriptor(
        4, 4, None, None)
    d = CudaGraphDispatcher([mixed, varlen, uniform])
    # All three fit 4 rows of 1 token... except uniform, which needs rows of exactly 4.
    assert d.dispatch(4, 4, 1, 1) == varlen
    # Four verify rows of 4 tokens: uniform preferred even though it is the biggest graph.
    assert d.dispatch(16, 4, 4, 4) == uniform
    # Ragged rows fit the varlen graph before the unbounded mixed one.
    assert d.dispatch(4, 2, 3, None) == varlen


def test_dispatch_respects_num_reqs():
    d = CudaGraphDispatcher([BatchDescriptor(8, 4, 4, None), BatchDescriptor(16, 16, 4, None)])
    assert d.dispatch(8, 8, 1, 1) == BatchDescriptor(16, 16, 4, None)
    assert CudaGraphDispatcher([BatchDescriptor(8, 4, 4, None)]).dispatch(8, 8, 1, 1) is None


def test_dispatch_too_big():
    d = CudaGraphDispatcher([BatchDescriptor(8, 8, 1, 1), BatchDescriptor(8, 8, None, None)])
    assert d.dispatch(9, 8, 1, 1) is None
    assert d.dispatch(9, 2, None, None) is None


def test_dispatch_verify_bound():
    k = 3
    descs = capture_descriptors([4, 8, 16], max_num_seqs=8, num_speculative_tokens=k, mode=M.FULL_DECODE_ONLY)
    d = CudaGraphDispatcher(descs)
    assert d.dispatch(8, 2, 1 + k, None) == BatchDescriptor(8, 8, 1 + k, None)
    assert d.dispatch(8, 2, 2 + k, None) is None


@pytest.mark.gpu
def test_capture_replay_matches_eager():
    runner = CUDAGraphRunner("cuda")
    x = torch.randn(64, device="cuda")
    desc = BatchDescriptor(64, 64, 1, 1)
    assert desc not in runner.graphs
    runner.capture(desc, lambda: x * 2 + 1)
    assert desc in runner.graphs
    x.copy_(torch.randn(64, device="cuda"))
    out = runner.replay(desc)
    torch.testing.assert_close(out, x * 2 + 1)
    x.fill_(3.0)
    assert torch.equal(runner.replay(desc), torch.full((64,), 7.0, device="cuda"))


def test_default_capture_sizes_cover_every_full_decode_batch():
    cfg = CompilationConfig()
    assert capture_sizes(cfg, max_num_seqs=256, max_num_batched_tokens=2048, num_speculative_tokens=0)[-1] == 256
    with_drafts = capture_sizes(cfg, 256, 2048, 3)
    assert with_drafts[-1] == 1024 and all(n % 4 == 0 for n in with_drafts)
    assert capture_sizes(cfg, 100, 2048, 0)[-1] == 100  # not a multiple of 8: still captured
    assert capture_sizes(cfg, 256, 96, 0)[-1] == 96  # the token budget bounds a decode batch too


@pytest.mark.parametrize("k", range(1, 8))
def test_verify_batches_of_the_default_request_counts_fill_their_graphs(k):
    """A verify batch of n requests (n = 1, 2, 4, 8, 16, 24, ...) has n * (1+K) tokens and replays a graph of
    exactly that size: rounding the token sizes alone left K=2's 4 requests (12 tokens) padded to 18."""
    sizes = capture_sizes(CompilationConfig(), max_num_seqs=64, max_num_batched_tokens=2048, num_speculative_tokens=k)
    assert all(n * (1 + k) in sizes for n in (1, 2, 4, 8, *range(16, 65, 8)))
    assert all(n % (1 + k) == 0 for n in sizes) and sizes[-1] == 64 * (1 + k)


def test_graphs_are_the_default_on_cuda_only():
    assert CompilationConfig().resolved_mode(torch.device("cuda")) == "FULL_AND_PIECEWISE"
    assert CompilationConfig().resolved_mode(torch.device("cpu")) == "NONE"
    assert CompilationConfig(enforce_eager=True).resolved_mode(torch.device("cuda")) == "NONE"
