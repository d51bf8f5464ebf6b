"""Full CUDA graphs for decode/verify (and, under FULL, mixed) batches: which to capture, which to replay (the
piecewise graphs of the other steps are in piecewise.py).

A `BatchDescriptor` keys one captured graph. The runner picks the capture sizes (`capture_sizes`), turns them
into descriptors (`capture_descriptors`) for the mode the attention backends allow (`resolve_mode`), captures
them with `CUDAGraphRunner` and at every step asks `CudaGraphDispatcher` for the smallest compatible graph; a
batch nothing fits runs eagerly.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from vllm.attention.backend import AttentionCGSupport
from vllm.config import CompilationConfig


class CUDAGraphMode(enum.Enum):
    NONE = "NONE"
    FULL_DECODE_ONLY = "FULL_DECODE_ONLY"
    FULL = "FULL"
    PIECEWISE = "PIECEWISE"  # no full graphs: every step runs in pieces (vllm/worker/piecewise.py)
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"  # full graphs for decode/verify batches, pieces for the rest

    @property
    def has_full_decode(self) -> bool:
        return self in (CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL, CUDAGraphMode.FULL_AND_PIECEWISE)

    @property
    def has_piecewise(self) -> bool:
        return self in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE)


@dataclass(frozen=True, slots=True)
class BatchDescriptor:
    num_tokens: int
    num_reqs: int
    max_query_len: int | None  # None: unbounded (a batch with a prefill row, or a FULL mixed graph)
    uniform_query_len: int | None  # every row has exactly this many tokens; None: ragged rows allowed


def capture_sizes(config: CompilationConfig, max_num_seqs: int, max_num_batched_tokens: int,
                  num_speculative_tokens: int) -> list[int]:
    """Token counts to capture, ascending.

    With K drafts a verify row has 1+K tokens, so sizes are rounded up to multiples of 1+K: a pure verify batch
    then fills a graph without padding rows. The default sizes are also read as request counts, each times 1+K:
    rounding alone leaves gaps among the small sizes, where padding costs most (K=2: 1, 2, 4, 8, 16 become 3,
    6, 9, 18, and 4 requests' 12 tokens padded to 18). A decode batch never has more than max_num_seqs * (1+K)
    tokens nor more than the token budget, so larger graphs would never replay, and the default sizes reach
    exactly that.
    """
    sizes = config.cudagraph_capture_sizes
    step = 1 + num_speculative_tokens
    cap = min(max_num_batched_tokens, max_num_seqs * step)
    if sizes is None:
        limit = config.max_cudagraph_capture_size or cap  # default: every full decode batch has a graph
        # Finer steps where padding costs most (small batches), as upstream: 8 up to 256, then 16, then 32.
        sizes = [n for n in (1, 2, 4) if n <= limit] + [n for n in (*range(8, 257, 8), *range(272, 513, 16),
                                                                     *range(544, limit + 1, 32)) if n <= limit]
        if config.max_cudagraph_capture_size is None and sizes[-1] < limit:
            sizes.append(limit)  # the largest decode batch there can be
        if step > 1:
            sizes += [n * step for n in sizes if n * step <= limit]  # verify batches of n requests
    return sorted({n for n in (-(-n // step) * step for n in sizes) if n <= cap})


def capture_descriptors(sizes: list[int], max_num_seqs: int, num_speculative_tokens: int,
                        mode: CUDAGraphMode) -> list[BatchDescriptor]:
    """One decode/verify graph per size, plus one mixed graph per size under FULL.

    Verify graphs are varlen (rows of 1..1+K tokens, e.g. under adaptive verification), so they are sized for the
    worst case of one token per request; without speculation every decode row has exactly one token.
    """
    if not mode.has_full_decode:
        return []
    k = num_speculative_tokens
    descs = [BatchDescriptor(n, min(n, max_num_seqs), 1 + k, None if k > 0 else 1) for n in sizes]
    if mode is CUDAGraphMode.FULL:
        descs += [BatchDescriptor(n, min(n, max_num_seqs), None, None) for n in sizes]
    return descs


def resolve_mode(requested: CUDAGraphMode, support: AttentionCGSupport,
                 num_speculative_tokens: int) -> tuple[CUDAGraphMode, str | None]:
    """The mode the attention backends allow (`support` is the minimum over all groups) and why it was lowered."""
    mode, reason = requested, None
    if mode is CUDAGraphMode.FULL and support < AttentionCGSupport.ALWAYS:
        mode = CUDAGraphMode.FULL_DECODE_ONLY
        reason = (f"FULL needs every attention backend to support ALWAYS (mixed prefill+decode batches), "
                  f"the weakest supports {support.name}; using FULL_DECODE_ONLY")
    if mode in (CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE):
        # Our verify graphs are varlen (rows of 1..1+K tokens): VARLEN_DECODE backends and better replay them.
        need = (AttentionCGSupport.VARLEN_DECODE if num_speculative_tokens > 0
                else AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE)
        if support < need:
            what = (f"varlen verify graphs (num_speculative_tokens={num_speculative_tokens})"
                    if num_speculative_tokens > 0 else "1-token decode graphs")
            # Pieces never capture a core, so they need no backend support.
            lowered = CUDAGraphMode.PIECEWISE if mode is CUDAGraphMode.FULL_AND_PIECEWISE else CUDAGraphMode.NONE
            reason = (f"{(reason + '; then ') if reason else ''}{what} need attention support {need.name}, "
                      f"the weakest backend supports {support.name}; using cudagraph_mode {lowered.value}")
            mode = lowered
    return mode, reason


class CudaGraphDispatcher:
    """Picks the captured graph a batch replays in, after padding to its num_tokens and num_reqs."""

    def __init__(self, descriptors: list[BatchDescriptor]) -> None:
        # Sorted once by preference, so dispatch returns the first compatible one: uniform graphs take the
        # cheapest kernel path, bounded graphs assume short rows, and fewer tokens/requests mean less padding.
        self.descriptors = sorted(descriptors, key=lambda d: (d.uniform_query_len is None, d.max_query_len is None,
                                                              d.num_tokens, d.num_reqs))

    def dispatch(self, num_tokens: int, num_reqs: int, max_query_len: int | None,
                 uniform_query_len: int | None) -> BatchDescriptor | None:
        """The preferred compatible graph, or None to run eagerly.

        `max_query_len` None means the batch has a prefill row: it must never replay a bounded decode graph,
        whose kernels were captured for short rows only.
        """
        for d in self.descriptors:
            if (d.num_tokens >= num_tokens and d.num_reqs >= num_reqs
                    and (d.uniform_query_len is None or d.uniform_query_len == uniform_query_len)
                    and (d.max_query_len is None or (max_query_len is not None and max_query_len <= d.max_query_len))):
                return d
        return None


class CUDAGraphRunner:
    """Captures and replays full CUDA graphs, all sharing one memory pool.

    The caller captures the largest descriptor first so that smaller graphs reuse the pool's blocks.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        with torch.cuda.device(self.device):
            self.pool = torch.cuda.graph_pool_handle()
            # One side stream for every warm-up: the caching allocator keeps freed blocks per stream, so a new
            # stream per capture would leave each warm-up's blocks behind, unusable by the next.
            self.side = torch.cuda.Stream()
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = {}

    def capture(self, desc: Hashable, fn: Callable[[], Any], warmup: int = 1) -> None:
        """Record `fn` as the graph for `desc` (a BatchDescriptor, or the DSpark draft's DraftGraphKey) and keep
        its output (a tensor, or a tuple of them).

        `fn` must read only persistent buffers (tensors that outlive the capture and that the caller refills in
        place before each replay): a graph replays fixed addresses, so a fresh tensor made outside `fn` would be
        read stale or freed. Warm-up runs eagerly first so lazy initialisation (kernel autotuning, cuBLAS
        workspaces) happens outside the capture; torch wants it on a side stream.
        """
        with torch.cuda.device(self.device):
            main, side = torch.cuda.current_stream(), self.side
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    fn()
            main.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = fn()
        self.graphs[desc] = (graph, out)

    def replay(self, desc: Hashable) -> Any:
        """Replay the graph for `desc`; returns its (padded) output, which the next replay overwrites."""
        graph, out = self.graphs[desc]
        graph.replay()
        return out
