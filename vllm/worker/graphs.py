"""The step's CUDA graphs, the runner's side: the mode the backends allow, which graphs to capture, the memory
they take (measured before the cache is sized), their capture over the real pools, and per step the path that
runs it (a full graph, the piecewise graphs, or eagerly). The graph types themselves are in cudagraph.py and
piecewise.py.
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from vllm.attention.backend import CommonAttentionMetadata, HybridAttentionMetadata
from vllm.config import VllmConfig
from vllm.spec_decode.dspark import DraftGraphKey, DSparkProposer
from vllm.worker.cudagraph import (BatchDescriptor, CudaGraphDispatcher, CUDAGraphMode, CUDAGraphRunner,
                                   capture_descriptors, capture_sizes, resolve_mode)
from vllm.worker.decode_tail import DecodeTail
from vllm.worker.input_batch import InputBatch
from vllm.worker.piecewise import PiecewiseCUDAGraphs, piecewise_sizes

logger = logging.getLogger(__name__)

# The graph pool measured on the largest graph, with room for the other graphs' executable state.
GRAPH_MEMORY_MARGIN = 1.2
GRAPH_MEMORY_SLACK_BYTES = 64 << 20

Forward = Callable[..., torch.Tensor]  # (num_tokens, common, capturing=False)


def choose_mode(config: VllmConfig, device: torch.device, builders: list, attn_res: bool) -> CUDAGraphMode:
    """The asked-for graph mode, lowered (with the reason logged) to what the backends can replay."""
    requested = CUDAGraphMode(config.compilation_config.resolved_mode(device))
    support = min(b.cudagraph_support for b in builders)
    mode, reason = resolve_mode(requested, support, config.num_speculative_tokens)
    if mode.has_piecewise and attn_res:
        lowered = CUDAGraphMode.NONE if mode is CUDAGraphMode.PIECEWISE else CUDAGraphMode.FULL_DECODE_ONLY
        reason = (f"{(reason + '; then ') if reason else ''}piecewise graphs need a forward in pieces, which "
                  f"AttnRes stacks (attn_res_block_size) do not have; using {lowered.value}")
        mode = lowered
    if reason is not None:
        logger.warning("cudagraph_mode %s -> %s: %s", requested.value, mode.value, reason)
    return mode


def free_device_bytes(device: torch.device) -> int:
    """Free device memory; 0 off CUDA (where the worker tests stand a rerun in for capture)."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0


class StepGraphs:
    """The graphs of one runner. `forward` runs the target (and writes the draft's context) on the input batch;
    `forward_with_tail` adds the decode tail, which bounded (decode/verify) graphs compute too."""

    def __init__(self, config: VllmConfig, device: torch.device, mode: CUDAGraphMode, backend_names: str,
                 model: torch.nn.Module, input_batch: InputBatch, drafter: DSparkProposer | None, forward: Forward,
                 forward_with_tail: Callable[..., DecodeTail],
                 attn_metadata: Callable[[CommonAttentionMetadata], HybridAttentionMetadata]) -> None:
        self.config, self.device, self.mode, self.backend_names = config, device, mode, backend_names
        self.model, self.input_batch, self.drafter = model, input_batch, drafter
        self.forward, self.forward_with_tail, self.attn_metadata = forward, forward_with_tail, attn_metadata
        sc = config.scheduler_config
        num_spec = config.num_speculative_tokens
        sizes = capture_sizes(config.compilation_config, sc.max_num_seqs, sc.max_num_batched_tokens, num_spec)
        # Largest first: smaller graphs then reuse its memory pool.
        self.descriptors = sorted(capture_descriptors(sizes, sc.max_num_seqs, num_spec, mode),
                                  key=lambda d: (-d.num_tokens, -d.num_reqs))
        self.piece_sizes = piecewise_sizes(sc.max_num_batched_tokens) if mode.has_piecewise else []
        self.dispatcher = CudaGraphDispatcher([])
        self.captured: CUDAGraphRunner | None = None  # the full (and draft) graphs, once captured
        self.piecewise: PiecewiseCUDAGraphs | None = None

    @property
    def wanted(self) -> bool:
        return bool(self.descriptors or self.piece_sizes)

    # ---- per step ---------------------------------------------------------------------------------------------
    def graph_for(self, common: CommonAttentionMetadata) -> BatchDescriptor | None:
        """The captured graph this step replays in, or None to run eagerly (or in pieces)."""
        if self.captured is None:
            return None
        n = common.num_reqs
        # numpy views: torch ops on these small host tensors cost microseconds each, on every step
        if common.is_prefilling[:n].numpy().any():
            if self.mode is not CUDAGraphMode.FULL:
                return None
            # A prompt chunk must never replay a bounded decode graph: unbounded (mixed) graphs only.
            return self.dispatcher.dispatch(common.num_actual_tokens, n, None, None)
        lens = np.diff(common.query_start_loc_cpu[:n + 1].numpy())
        uniform = int(lens[0]) if n and (lens == lens[0]).all() else None
        return self.dispatcher.dispatch(common.num_actual_tokens, n, common.max_query_len, uniform)

    def run(self, common: CommonAttentionMetadata) -> tuple[torch.Tensor, DecodeTail | None]:
        """The step's forward on its path: the hidden states of its tokens and, where a bounded graph replayed,
        that graph's decode tail. A graph's outputs are its own buffers, overwritten by its next replay:
        everything that reads them (this step's host copies and drafts, the next step's tokens) is queued first."""
        T = common.num_actual_tokens
        desc = self.graph_for(common)
        if desc is None and self.piecewise is not None and T <= self.piecewise.max_size:
            hidden = self.piecewise.run(T, self.attn_metadata(common))
            if self.drafter is not None:
                self.drafter.write_context(T, self.input_batch.positions.gpu, common.slot_mapping)
            return hidden, None
        if desc is None:
            return self.forward(T, common), None
        self.input_batch.pad_for_graph(common.num_reqs, T, desc.num_reqs, desc.num_tokens)
        replayed = self.captured.replay(desc)
        if isinstance(replayed, DecodeTail):
            return replayed.hidden[:T], replayed
        return replayed[:T], None

    # ---- capture ----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def measure_bytes(self, bind_scratch: Callable[[int], object]) -> int:
        """Device memory the graphs will hold, measured before the cache is sized: the largest full graph and the
        largest size's pieces (with their buffers) captured over scratch caches of one block and the null slot
        (all a capture touches; `bind_scratch(1)` binds them and returns what keeps them alive), then released.
        Smaller graphs share the pool; a margin covers their own executable state. 0 off CUDA or graphless."""
        if self.device.type != "cuda" or not self.wanted:
            return 0
        scratch = bind_scratch(1)
        torch.cuda.synchronize(self.device)
        free_before = free_device_bytes(self.device)
        trial = CUDAGraphRunner(self.device)
        largest, largest_pieces = self.descriptors[:1], self.piece_sizes[-1:]
        for desc in largest:
            self._capture_one(trial, desc)
        for key in self._draft_graph_keys()[:1] if largest else []:
            self._capture_draft(trial, key)
        pieces = self._pieces(trial, largest_pieces)
        for size in largest_pieces:
            pieces.capture(size)
        torch.cuda.synchronize(self.device)
        used = free_before - free_device_bytes(self.device)
        del trial, pieces, scratch
        torch.cuda.empty_cache()
        return int(used * GRAPH_MEMORY_MARGIN) + GRAPH_MEMORY_SLACK_BYTES

    @torch.inference_mode()
    def capture(self, reserved_bytes: int) -> None:
        """Captures one graph per descriptor and the pieces at each size, largest first, over the real pools."""
        if not self.wanted:
            return
        descs, pieces = self.descriptors, self.piece_sizes
        self.dispatcher = CudaGraphDispatcher(descs)
        self.captured = CUDAGraphRunner(self.device)
        self.piecewise = self._pieces(self.captured, pieces)
        free_before = free_device_bytes(self.device)
        start = time.monotonic()
        draft_keys = self._draft_graph_keys() if descs else []
        work = [("full", d) for d in descs] + [("pieces", n) for n in reversed(pieces)] + \
            [("draft", k) for k in draft_keys]
        for kind, what in tqdm(work, desc="Capturing CUDA graphs"):
            if kind == "full":
                self._capture_one(self.captured, what)
            elif kind == "pieces":
                self._capture_pieces(what)
            else:
                self._capture_draft(self.captured, what)
        if draft_keys:
            self.drafter.use_graphs(self.captured, draft_keys)
        used = free_before - free_device_bytes(self.device)
        what = [f"{len(descs)} full ({descs[-1].num_tokens}..{descs[0].num_tokens} tokens)"] if descs else []
        if pieces:
            what.append(f"{len(pieces)} x {len(self.model.model.layers) + 1} piecewise ({pieces[0]}..{pieces[-1]} "
                        "tokens)")
        if draft_keys:
            what.append(f"{len(draft_keys)} DSpark draft ({draft_keys[-1].num_reqs}..{draft_keys[0].num_reqs} "
                        f"requests x contexts {self.drafter.graph_contexts[0]}..{self.drafter.graph_contexts[-1]})")
        logger.info("captured CUDA graphs (%s): %s, in %.1f s: %.1f MiB (%.1f MiB were set aside when the cache "
                    "was sized)", self.mode.value, ", ".join(what), time.monotonic() - start,
                    used / 2**20, reserved_bytes / 2**20)
        if used > reserved_bytes > 0:
            logger.warning("the CUDA graphs took %.1f MiB more than was set aside for them; lower "
                           "--gpu-memory-utilization if memory runs short", (used - reserved_bytes) / 2**20)

    def _capture_one(self, graphs: CUDAGraphRunner, desc: BatchDescriptor) -> None:
        n, T = desc.num_reqs, desc.num_tokens
        max_q = desc.max_query_len or T
        self.input_batch.fill_for_capture(n, T, max_q)
        common = self.input_batch.graph_metadata(n, T, max_q, self.config.scheduler_config.max_model_len)
        # Metadata is built inside the capture: its device-side work then reruns on every replay against the
        # refilled buffers, and its host-side choices are fixed by the descriptor. A decode/verify graph (bounded
        # rows: no prompt chunk) also computes the decode tail; a mixed graph's tokens are mostly not logits rows.
        fn = self.forward if desc.max_query_len is None else self.forward_with_tail
        try:
            graphs.capture(desc, functools.partial(fn, T, common, capturing=True))
        except Exception as e:  # a kernel that syncs with the host, or glue refusing the capture's dummies
            raise RuntimeError(f"capturing the CUDA graph for {desc} failed ({type(e).__name__}: {e}); backends: "
                               f"{self.backend_names}; run with --enforce-eager or "
                               '--compilation-config \'{"cudagraph_mode": "NONE"}\'') from e

    def _pieces(self, graphs: CUDAGraphRunner, sizes: list[int]) -> PiecewiseCUDAGraphs | None:
        return PiecewiseCUDAGraphs(self.model.model, self.input_batch.input_ids.gpu, graphs, sizes) if sizes else None

    def _draft_graph_keys(self) -> list[DraftGraphKey]:
        """The draft's graphs (none without a DSpark draft): one per request count of the decode graphs and
        context bucket, largest first. Only decode and verify steps draft, so their request counts occur."""
        if self.drafter is None:
            return []
        return self.drafter.graph_shapes([d.num_reqs for d in self.descriptors],
                                         self.config.scheduler_config.max_model_len)

    def _capture_draft(self, graphs: CUDAGraphRunner, key: DraftGraphKey) -> None:
        try:
            graphs.capture(key, self.drafter.graph_fn(key))
        except Exception as e:  # noqa: BLE001 - an op of the draft that syncs with the host
            raise RuntimeError(f"capturing the DSpark draft's CUDA graph for {key} failed ({type(e).__name__}: "
                               f"{e}); run with --enforce-eager") from e

    def _capture_pieces(self, size: int) -> None:
        try:
            self.piecewise.capture(size)
        except Exception as e:  # noqa: BLE001 - a piece that syncs with the host
            raise RuntimeError(f"capturing the piecewise CUDA graphs at {size} tokens failed ({type(e).__name__}: "
                               f"{e}); run with --enforce-eager or "
                               '--compilation-config \'{"cudagraph_mode": "FULL_DECODE_ONLY"}\'') from e
