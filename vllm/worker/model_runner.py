"""ModelRunner: SchedulerOutput -> inputs -> CommonAttentionMetadata -> forward -> logits -> sampled tokens.

It owns the model, the cache pools (sized from the device memory, or the CPU budget, after loading) and
the persistent input buffers. Logits are computed only for rows that sample (and for prompt rows of
requests that asked for prompt_logprobs).
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from vllm.attention.backend import AttentionCGSupport, CommonAttentionMetadata, HybridAttentionMetadata, LayerShapes
from vllm.attention.selector import select_backends
from vllm.config import VllmConfig
from vllm.core.kv_cache_manager import KVCacheManager
from vllm.core.scheduler import SchedulerOutput
from vllm.model_executor.dspark_loader import load_dspark_draft
from vllm.model_executor.model_loader import load_model
from vllm.model_executor.models.kimi_k3.model import allocate_layer_caches
from vllm.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler, SpecDecodeMetadata
from vllm.sample.sampler import LogprobsTensors, Sampler, SamplingMetadata, gather_logprobs
from vllm.spec_decode.adaptive_verification import (AdaptiveVerifier, CostProfile, DraftConfidences, ProfileBatch,
                                                    ProfileTimings, StepTimes, SurvivalPrediction, VerifyCosts)
from vllm.spec_decode.dspark import DraftGraphKey, DSparkProposer
from vllm.utils import async_tensor_d2h, async_tensor_h2d
from vllm.worker.cache_sizing import CacheLayout, plan_cache
from vllm.worker.decode_tail import DecodeTail, decode_tail
from vllm.worker.cudagraph import (BatchDescriptor, CudaGraphDispatcher, CUDAGraphMode, CUDAGraphRunner,
                                   capture_descriptors, capture_sizes, resolve_mode)
from vllm.worker.input_batch import InFlightStep, InFlightTokens, InputBatch
from vllm.worker.piecewise import PiecewiseCUDAGraphs, piecewise_sizes
from vllm.worker.warmup import eager_warmup_steps

logger = logging.getLogger(__name__)

# The graph pool measured on the largest graph, with room for the other graphs' executable state.
GRAPH_MEMORY_MARGIN = 1.2
GRAPH_MEMORY_SLACK_BYTES = 64 << 20


# (scheduled step, its metadata) -> (row lengths the host shows, device int32 row lengths the kernels run), or
# None to run the step as scheduled
DeviceTrimHook = Callable[[SchedulerOutput, CommonAttentionMetadata], tuple[list[int], torch.Tensor] | None]


@dataclass(slots=True)
class ModelRunnerOutput:
    # per sampling request: its new tokens (accepted drafts, then the recovered or bonus token; one token
    # for a row without drafts)
    sampled: dict[str, list[int]] = field(default_factory=dict)
    # per request: (token ids [k+1], logprobs [k+1], rank) of the sampled token and the top-k
    logprobs: dict[str, tuple[list[int], list[float], int]] = field(default_factory=dict)
    # per request: rows for the prompt positions this step covered (first prompt token has none)
    prompt_logprobs: dict[str, list[tuple[list[int], list[float], int]]] = field(default_factory=dict)


@dataclass(slots=True)
class _HostLogprobs:
    """(token ids, logprobs, ranks) rows of a LogprobsTensors, copied to the host behind the step."""
    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor

    @classmethod
    def queue(cls, t: LogprobsTensors) -> _HostLogprobs:
        return cls(async_tensor_d2h(t.token_ids), async_tensor_d2h(t.logprobs), async_tensor_d2h(t.ranks))

    def lists(self) -> tuple[list, list, list]:
        return self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()


@dataclass(slots=True)
class AsyncModelRunnerOutput:
    """A step whose work is queued on the device: its results come back through host copies queued behind it,
    which get_output() waits for. Until then the host may schedule and prepare the next step, which reads this
    one's sampled tokens on the device (`in_flight_tokens`)."""
    sampled_token_ids: torch.Tensor | None = None  # device [rows that sampled without drafts]
    sample_rows: dict[str, int] = field(default_factory=dict)  # request -> its row in sampled_token_ids
    sample_logprob_ks: list[int | None] = field(default_factory=list)  # per sample row: logprobs asked for
    sampled_host: torch.Tensor | None = None
    logprobs_host: _HostLogprobs | None = None
    verify_rows: list[str] = field(default_factory=list)  # requests whose drafts were verified, in order
    verified: torch.Tensor | None = None  # device [rows, 1 + K] accepted tokens then placeholders
    verified_host: torch.Tensor | None = None
    prompt_logprobs_host: dict[str, _HostLogprobs] = field(default_factory=dict)
    # The DSpark drafts proposed for the next step: they stay on the device, where the next step's inputs take
    # them (InputBatch.prepare); the host only learns how many each request got.
    draft_rows: list[str] = field(default_factory=list)  # requests the DSpark draft proposed for, in order
    drafts: torch.Tensor | None = None  # device [draft rows, K]
    done: torch.cuda.Event | None = None  # recorded behind the host copies (CUDA only)
    waited: float = 0.0  # seconds get_output() waited for the device
    num_tokens: int = 0  # target tokens the step ran, after any device trim, without graph padding
    recut: bool = False  # the device re-cut the step (adaptive verification trimmed it)
    # Adaptive verification: what the budget of this all-verify step predicted, which its accepted drafts
    # calibrate (AdaptiveVerifier.observe); None for other steps.
    survival_prediction: SurvivalPrediction | None = None

    @property
    def in_flight_tokens(self) -> InFlightTokens | None:
        return None if self.sampled_token_ids is None else (self.sampled_token_ids, self.sample_rows)

    @property
    def in_flight_step(self) -> InFlightStep:
        return InFlightStep(self.sampled_token_ids, self.sample_rows, self.verified,
                            {rid: i for i, rid in enumerate(self.verify_rows)}, self.drafts,
                            {rid: i for i, rid in enumerate(self.draft_rows)})

    def get_output(self) -> ModelRunnerOutput:
        """Waits for the step's results (the one host-device synchronisation of a step) and returns them."""
        if self.done is not None:
            start = time.perf_counter()
            self.done.synchronize()
            self.waited = time.perf_counter() - start
        result = ModelRunnerOutput()
        if self.sampled_host is not None:
            ids = self.sampled_host.tolist()
            lp = self.logprobs_host.lists() if self.logprobs_host is not None else None
            for (rid, j), k in zip(self.sample_rows.items(), self.sample_logprob_ks):
                result.sampled[rid] = [ids[j]]
                if lp is not None and k is not None:
                    result.logprobs[rid] = (lp[0][j][:k + 1], lp[1][j][:k + 1], lp[2][j])
        if self.verified_host is not None:
            for rid, row in zip(self.verify_rows, self.verified_host.tolist()):
                # Accepted drafts are never placeholders, so the row's tokens are its non-placeholder prefix.
                result.sampled[rid] = [t for t in row if t != PLACEHOLDER_TOKEN_ID]
        for rid, host in self.prompt_logprobs_host.items():
            t = host.lists()
            result.prompt_logprobs[rid] = list(zip(t[0], t[1], t[2]))
        return result


class ModelRunner:
    def __init__(self, config: VllmConfig) -> None:
        self.config = config
        mc = config.model_config
        self.device, self.dtype = mc.device, mc.dtype
        torch.manual_seed(mc.seed)
        # Decays of long prompts underflow into denormals, which are ~100x slower on CPUs; flush them to zero.
        torch.set_flush_denormal(True)
        if self.device.type == "cuda" and self.dtype == torch.float32:
            # At the 4-16 rows of verify steps and small decode batches cuBLAS's heuristic picks fp32 kernels
            # 10-20x slower than cuBLASLt's (benchmarks/kernels/bench_small_gemm.py). The choice is per process.
            torch.backends.cuda.preferred_blas_library("cublaslt")
        hf, cc = mc.hf_config, config.cache_config
        shapes = LayerShapes(kda_num_heads=hf.kda_num_heads, kda_head_dim=hf.kda_head_dim,
                             kda_gate_bounded=hf.gate_lower_bound is not None,
                             ssm_state_dtype=cc.mamba_ssm_cache_dtype, mla_num_heads=hf.num_attention_heads,
                             kv_lora_rank=hf.kv_lora_rank, qk_rope_head_dim=hf.qk_rope_head_dim,
                             block_size=cc.block_size, num_speculative_tokens=config.num_speculative_tokens)
        backends = select_backends(config.kernel_config, self.device, self.dtype, shapes)
        self.backend_names = (f"MLA {backends.mla.name}, KDA prefill {backends.kda.prefill.name}, "
                              f"KDA decode {backends.kda.decode.name}")
        logger.info("attention backends: %s", self.backend_names)
        self.model = load_model(mc.model, self.dtype, self.device, backends, mc.hf_config)
        self.hf_config = mc.hf_config
        self.block_size = config.cache_config.block_size
        self.kda_builder = backends.kda.builder(self.block_size) if self.hf_config.kda_layers else None
        self.kda_prefill_backend = backends.kda.prefill
        self.conv_history_major = backends.kda.conv_state_history_major
        self.mla_builder = backends.mla.builder(self.block_size) if self.hf_config.mla_layers else None
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()
        self.num_spec = config.num_speculative_tokens
        self.drafter = self._load_drafter()
        self.confidences = DraftConfidences(self.num_spec, self.device)
        self.layout: CacheLayout | None = None
        self.cudagraph_mode = self._cudagraph_mode()
        self.device_trim_hook: DeviceTrimHook | None = None
        self.adaptive_verifier: AdaptiveVerifier | None = None  # the device-trim hook of adaptive verification
        # Adaptive verification's measured all-verify steps: the engine records them, the budget reads them.
        self.step_times: StepTimes | None = None
        self.dispatcher = CudaGraphDispatcher([])
        self.graphs: CUDAGraphRunner | None = None
        self.piecewise: PiecewiseCUDAGraphs | None = None

    def _load_drafter(self) -> DSparkProposer | None:
        spec = self.config.speculative_config
        if spec is None or spec.method != "dspark":
            return None
        draft = load_dspark_draft(spec.model, self.hf_config, self.dtype, self.device)
        if spec.enable_adaptive_verification and not draft.config.enable_confidence_head:
            raise ValueError(f"--speculative-config enable_adaptive_verification needs a draft with a confidence head; "
                             f"{spec.model} has enable_confidence_head=false")
        logger.info("DSpark draft %s: %d layers over target layers %s, K=%d", spec.model,
                    draft.config.num_hidden_layers, list(draft.config.target_layer_ids), self.num_spec)
        sc = self.config.scheduler_config
        return DSparkProposer(draft, self.model, self.num_spec, sc.max_num_batched_tokens, sc.max_num_seqs,
                              -(-sc.max_model_len // self.block_size))

    def set_device_trim_hook(self, hook: DeviceTrimHook | None) -> None:
        """Installs the adaptive-verification seam: on a step where every row verifies drafts, the hook gets
        the scheduled step and its metadata and returns (cpu_lens, device_lens): new row lengths (each
        1..scheduled, same total) as the host metadata shows them and as the device runs them, or None to run
        the step as scheduled. Only backends that take row lengths from the device offsets can run such steps."""
        builders = [b for b in (self.kda_builder, self.mla_builder) if b is not None]
        unable = [type(b).__name__ for b in builders if not b.supports_device_cpu_query_lens_mismatch()]
        if hook is not None and unable:
            raise ValueError(f"trimming drafts on the device needs attention backends that read row lengths from "
                             f"the device offsets; {', '.join(unable)} read the host copies")
        self.device_trim_hook = hook

    # Adaptive verification as the engine sees it: it hands over its loop's periods and the steps' outcomes, and
    # reads counters; the verifier, the step times and the confidences stay here.
    def record_step_period(self, period: float, waited: float, drained: tuple[int, int, bool] | None) -> None:
        """The engine loop's period (seconds) from an all-verify step to the next, its waits for the device, and
        the all-verify step it waited for (StepTimes.record). Kept only where step times are (on CUDA)."""
        if self.step_times is not None:
            self.step_times.record(period, waited, drained)

    def observe_acceptance(self, launched: AsyncModelRunnerOutput, output: ModelRunnerOutput) -> None:
        """What a landed step's verify rows accepted, which calibrates the survivals its budget read (only an
        all-verify step whose survivals were read carries a prediction)."""
        if launched.survival_prediction is not None:
            self.adaptive_verifier.observe(launched.survival_prediction,
                                           [len(output.sampled[rid]) - 1 for rid in launched.verify_rows])

    def adaptive_stats(self) -> dict[str, int] | None:
        """Adaptive verification's SpecDecodeStats fields since start; None where it does not run."""
        verifier = self.adaptive_verifier
        if verifier is None:
            return None
        return {"num_unverified_draft_tokens": verifier.num_offered - verifier.num_kept,
                "num_remeasure_steps": verifier.num_refreshed}

    def _cudagraph_mode(self) -> CUDAGraphMode:
        """The asked-for graph mode, lowered (with the reason logged) to what the backends can replay."""
        cc = self.config.compilation_config
        requested = CUDAGraphMode(cc.resolved_mode(self.device))
        builders = [b for b in (self.kda_builder, self.mla_builder) if b is not None]
        support = min(b.cudagraph_support for b in builders)
        mode, reason = resolve_mode(requested, support, self.num_spec)
        if mode.has_piecewise and self.hf_config.attn_res_block_size is not None:
            lowered = CUDAGraphMode.NONE if mode is CUDAGraphMode.PIECEWISE else CUDAGraphMode.FULL_DECODE_ONLY
            reason = (f"{(reason + '; then ') if reason else ''}piecewise graphs need a forward in pieces, which "
                      f"AttnRes stacks (attn_res_block_size) do not have; using {lowered.value}")
            mode = lowered
        if reason is not None:
            logger.warning("cudagraph_mode %s -> %s: %s", requested.value, mode.value, reason)
        return mode

    def initialize_cache(self) -> KVCacheManager:
        """Sizes and allocates the cache pools after a profile run (and, with CUDA graphs, a trial capture that
        measures their memory pool), binds them, captures the graphs, returns the pools' manager."""
        cc, sc = self.config.cache_config, self.config.scheduler_config
        max_blocks = -(-sc.max_model_len // self.block_size)
        self.input_batch = InputBatch(sc.max_num_seqs, sc.max_num_batched_tokens, max_blocks, self.block_size,
                                      self.device, slots_per_request=1 + self.num_spec)
        descs = self._graph_descriptors()
        pieces = piecewise_sizes(sc.max_num_batched_tokens) if self.cudagraph_mode.has_piecewise else []
        peak = self._profile_peak_bytes()
        graph_bytes = self._measure_graph_bytes(descs[:1], pieces[-1:]) if descs or pieces else 0
        self.layout = plan_cache(self.config, peak, graph_bytes)
        lay = self.layout
        caches = allocate_layer_caches(self.hf_config, lay.num_blocks, self.block_size, lay.num_state_slots,
                                       self.dtype, cc.mamba_ssm_cache_dtype, self.device, self.conv_history_major)
        self.model.bind_caches(caches)
        if self.drafter is not None:
            self.drafter.allocate_caches(lay.num_blocks, self.block_size)
        kv = KVCacheManager(lay.num_blocks, self.block_size, lay.num_state_slots,
                            needs_blocks=bool(self.hf_config.mla_layers) or self.drafter is not None,
                            needs_slots=bool(self.hf_config.kda_layers), slots_per_request=1 + self.num_spec)
        if descs or pieces:
            self._capture_cudagraphs(descs, pieces, graph_bytes)
        if self.device.type == "cuda":  # elsewhere nothing compiles (torch kernels, or Triton's interpreter)
            self.warm_up_eager_steps()
        spec = self.config.speculative_config
        if spec is not None and spec.enable_adaptive_verification:
            self._check_adaptive_gates()
            costs = self._profile_step_costs(descs)
            # Off CUDA the host runs the forward itself: nothing apart from the tables to weigh, none measured.
            self.step_times = StepTimes(sc.async_scheduling, costs.verify.padded) if self.device.type == "cuda" \
                else None
            self.adaptive_verifier = AdaptiveVerifier(self.confidences, costs, sc.max_num_batched_tokens,
                                                      self.step_times)
            self.set_device_trim_hook(self.adaptive_verifier)
        return kv

    @torch.inference_mode()
    def warm_up_eager_steps(self) -> None:
        """One eager forward of each step shape in `warmup.eager_warmup_steps`, over harmless inputs (no cache
        writes, the null state slot), so that their kernels compile now and not under the first requests."""
        sc = self.config.scheduler_config
        # The backends' own thresholds, where they have them; without one, that choice does not exist.
        short = getattr(self.mla_builder, "prefill_min_query_len", 16)
        recurrent = getattr(self.kda_prefill_backend, "recurrent_prefill_max_len", 256)
        steps = eager_warmup_steps(sc.max_num_seqs, sc.max_num_batched_tokens, sc.max_model_len, short, recurrent)
        start = time.monotonic()
        for step in steps:
            lens, contexts = np.array(step.query_lens), np.array(step.context_lens)
            self.input_batch.fill_dummy(lens, contexts, np.array(step.prefilling))
            common = self.input_batch.dummy_metadata(len(lens), step.num_tokens, int(lens.max()),
                                                     int((lens + contexts).max()))
            self._forward(step.num_tokens, common)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("warmed up %d eager step shapes in %.1f s", len(steps), time.monotonic() - start)

    def _graph_descriptors(self) -> list[BatchDescriptor]:
        """The graphs to capture, largest first (smaller ones then reuse its memory pool)."""
        sc = self.config.scheduler_config
        sizes = capture_sizes(self.config.compilation_config, sc.max_num_seqs, sc.max_num_batched_tokens,
                              self.num_spec)
        descs = capture_descriptors(sizes, sc.max_num_seqs, self.num_spec, self.cudagraph_mode)
        return sorted(descs, key=lambda d: (-d.num_tokens, -d.num_reqs))

    @torch.inference_mode()
    def _measure_graph_bytes(self, largest: list[BatchDescriptor], largest_pieces: list[int]) -> int:
        """Device memory the graphs will hold, measured before the cache is sized: the largest full graph and the
        largest size's pieces (with their buffers) captured over scratch caches of one block and the null slot
        (all a capture touches), then released. Smaller graphs share the pool; a margin covers their own
        executable state. 0 off CUDA."""
        if self.device.type != "cuda":
            return 0
        cc = self.config.cache_config
        scratch = allocate_layer_caches(self.hf_config, 1, self.block_size, 1, self.dtype, cc.mamba_ssm_cache_dtype,
                                        self.device, self.conv_history_major)
        self.model.bind_caches(scratch)
        if self.drafter is not None:
            self.drafter.allocate_caches(1, self.block_size)
        torch.cuda.synchronize(self.device)
        free_before = self._free_device_bytes()
        trial = CUDAGraphRunner(self.device)
        for desc in largest:
            self._capture_one(trial, desc)
        for key in self._draft_graph_keys()[:1] if largest else []:
            self._capture_draft(trial, key)
        pieces = self._piecewise(trial, largest_pieces)
        for size in largest_pieces:
            pieces.capture(size)
        torch.cuda.synchronize(self.device)
        used = free_before - self._free_device_bytes()
        del trial, pieces, scratch
        torch.cuda.empty_cache()
        return int(used * GRAPH_MEMORY_MARGIN) + GRAPH_MEMORY_SLACK_BYTES

    def _capture_one(self, graphs: CUDAGraphRunner, desc: BatchDescriptor) -> None:
        sc = self.config.scheduler_config
        n, T = desc.num_reqs, desc.num_tokens
        max_q = desc.max_query_len or T
        self.input_batch.fill_for_capture(n, T, max_q)
        common = self.input_batch.graph_metadata(n, T, max_q, sc.max_model_len)
        # Metadata is built inside the capture: its device-side work then reruns on every replay against the
        # refilled buffers, and its host-side choices are fixed by the descriptor. A decode/verify graph (bounded
        # rows: no prompt chunk) also computes the decode tail; a mixed graph's tokens are mostly not logits rows.
        fn = self._forward if desc.max_query_len is None else self._forward_with_tail
        try:
            graphs.capture(desc, functools.partial(fn, T, common))
        except Exception as e:  # a kernel that syncs with the host, or glue refusing the capture's dummies
            raise RuntimeError(f"capturing the CUDA graph for {desc} failed ({type(e).__name__}: {e}); backends: "
                               f"{self.backend_names}; run with --enforce-eager or "
                               '--compilation-config \'{"cudagraph_mode": "NONE"}\'') from e

    def _piecewise(self, graphs: CUDAGraphRunner, sizes: list[int]) -> PiecewiseCUDAGraphs | None:
        return PiecewiseCUDAGraphs(self.model.model, self.input_batch.input_ids.gpu, graphs, sizes) if sizes else None

    @torch.inference_mode()
    def _capture_cudagraphs(self, descs: list[BatchDescriptor], pieces: list[int], reserved_bytes: int) -> None:
        """Captures one graph per descriptor and the pieces at each size, largest first, over the real pools."""
        self.dispatcher = CudaGraphDispatcher(descs)
        self.graphs = CUDAGraphRunner(self.device)
        self.piecewise = self._piecewise(self.graphs, pieces)
        free_before = self._free_device_bytes()
        start = time.monotonic()
        draft_keys = self._draft_graph_keys() if descs else []
        work = [("full", d) for d in descs] + [("pieces", n) for n in reversed(pieces)] + \
            [("draft", k) for k in draft_keys]
        for kind, what in tqdm(work, desc="Capturing CUDA graphs"):
            if kind == "full":
                self._capture_one(self.graphs, what)
            elif kind == "pieces":
                self._capture_pieces(what)
            else:
                self._capture_draft(self.graphs, what)
        if draft_keys:
            self.drafter.use_graphs(self.graphs, draft_keys)
        used = free_before - self._free_device_bytes()
        what = [f"{len(descs)} full ({descs[-1].num_tokens}..{descs[0].num_tokens} tokens)"] if descs else []
        if pieces:
            what.append(f"{len(pieces)} x {len(self.model.model.layers) + 1} piecewise ({pieces[0]}..{pieces[-1]} "
                        "tokens)")
        if draft_keys:
            what.append(f"{len(draft_keys)} DSpark draft ({draft_keys[-1].num_reqs}..{draft_keys[0].num_reqs} "
                        f"requests x contexts {self.drafter.graph_contexts[0]}..{self.drafter.graph_contexts[-1]})")
        logger.info("captured CUDA graphs (%s): %s, in %.1f s: %.1f MiB (%.1f MiB were set aside when the cache "
                    "was sized)", self.cudagraph_mode.value, ", ".join(what), time.monotonic() - start,
                    used / 2**20, reserved_bytes / 2**20)
        if used > reserved_bytes > 0:
            logger.warning("the CUDA graphs took %.1f MiB more than was set aside for them; lower "
                           "--gpu-memory-utilization if memory runs short", (used - reserved_bytes) / 2**20)

    def _draft_graph_keys(self) -> list[DraftGraphKey]:
        """The draft's graphs (none without a DSpark draft): one per request count of the decode graphs and
        context bucket, largest first. Only decode and verify steps draft, so their request counts occur."""
        if self.drafter is None:
            return []
        return self.drafter.graph_shapes([d.num_reqs for d in self._graph_descriptors()],
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

    def _check_adaptive_gates(self) -> None:
        """Adaptive verification re-cuts verify rows on the device: every target backend must replay any decode
        shape (VARLEN_DECODE or better) and, on a GPU, the step must run in CUDA graphs. (Reading row lengths
        from the device offsets is checked by set_device_trim_hook.)"""
        flag = "--speculative-config enable_adaptive_verification"
        builders = [b for b in (self.kda_builder, self.mla_builder) if b is not None]
        weak = [f"{type(b).__name__} ({b.cudagraph_support.name})" for b in builders
                if b.cudagraph_support < AttentionCGSupport.VARLEN_DECODE]
        if weak:
            raise ValueError(f"{flag} needs attention backends that replay any decode shape (VARLEN_DECODE or "
                             f"ALWAYS); {', '.join(weak)} cannot; backends: {self.backend_names}")
        if self.device.type == "cuda" and self.graphs is None:
            raise ValueError(f"{flag} runs on CUDA graphs on a GPU (cudagraph_mode is {self.cudagraph_mode.value});"
                             " drop --enforce-eager")

    @torch.inference_mode()
    def _profile_step_costs(self, descs: list[BatchDescriptor]) -> VerifyCosts:
        """Adaptive verification's cost tables: the package says which dummy steps to time and folds the
        timings (CostProfile); here each runs: its forward, the draft over its requests, and its re-cut."""
        sc = self.config.scheduler_config
        profile = CostProfile(self.num_spec, sc.max_num_seqs, sc.max_num_batched_tokens, sc.max_model_len,
                              sorted({d.num_tokens for d in descs}))
        samples = []
        for batch in profile.batches_to_profile():
            common, _, run = self.dummy_decode_step(batch.num_tokens, batch.context)
            verify = self._timed(run, profile.repeats)
            zeros = torch.zeros(batch.num_reqs, dtype=torch.int64, device=self.device)
            draft = self._timed(lambda: self.drafter.propose(zeros, zeros, common.block_table[:batch.num_reqs],
                                                             batch.context, with_confidence=True), profile.repeats)
            samples.append((batch, ProfileTimings(verify, draft, self._timed_recut(profile, batch))))
        return profile.set_initial_cost_curves(samples)

    def _timed_recut(self, profile: CostProfile, batch: ProfileBatch) -> list[float]:
        """Timings of what a trimmed step runs besides its graph, as execute_model runs it: the package's re-cut
        of the batch, the input batch's trim and the copy of its row lengths. Each on a fresh dummy step (the
        re-cut shortens its rows), after one untimed run."""
        recut = profile.recut_dummy(batch, self.device)

        def run(common: CommonAttentionMetadata) -> None:
            host, device_lens = recut.lengths()
            self.input_batch.trim_on_device(common, host, device_lens)
            async_tensor_d2h(device_lens)
        times = []
        for _ in range(profile.repeats + 1):
            common, _, _ = self.dummy_decode_step(batch.num_tokens, batch.context)
            times += self._timed(functools.partial(run, common), 1)
        return times[1:]

    def dummy_decode_step(self, num_tokens: int, context: int
                          ) -> tuple[CommonAttentionMetadata, BatchDescriptor | None, Callable[[], object]]:
        """A decode or verify step of `num_tokens` tokens on harmless inputs (InputBatch.fill_dummy): rows of 1+K
        tokens (the last one shorter) over `context` cached tokens each. Returns its metadata, the graph it
        replays (None: eager) and a function that runs its forward, padded for that graph; for the cost tables
        and benchmarks/profile_step_sizes.py. Valid until the input batch is refilled."""
        per_req = 1 + self.num_spec
        n_reqs = -(-num_tokens // per_req)
        lens = np.full(n_reqs, per_req)
        lens[-1] = num_tokens - per_req * (n_reqs - 1)
        self.input_batch.fill_dummy(lens, np.full(n_reqs, context), np.zeros(n_reqs, dtype=bool))
        common = self.input_batch.dummy_metadata(n_reqs, num_tokens, per_req, context + per_req)
        desc = self._graph_for(common)
        if desc is None:
            return common, None, lambda: self._forward(num_tokens, common)
        self.input_batch.pad_for_graph(n_reqs, num_tokens, desc.num_reqs, desc.num_tokens)
        return common, desc, lambda: self.graphs.replay(desc)

    def _timed(self, fn: Callable[[], object], repeats: int) -> list[float]:
        times = []
        for _ in range(repeats):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - start)
        return times

    def _free_device_bytes(self) -> int:
        """Free device memory; 0 off CUDA (where the worker tests stand a rerun in for capture)."""
        return torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0

    def _forward(self, num_tokens: int, common: CommonAttentionMetadata) -> torch.Tensor:
        """The target's forward, then (with a DSpark draft) the step's context into the draft's caches: both in
        one graph where the step replays one."""
        batch = self.input_batch
        hidden = self.model(batch.input_ids.gpu[:num_tokens], batch.positions.gpu[:num_tokens],
                            self._attn_metadata(common))
        if self.drafter is not None:
            self.drafter.write_context(num_tokens, batch.positions.gpu, common.slot_mapping)
        return hidden

    def _forward_with_tail(self, num_tokens: int, common: CommonAttentionMetadata) -> DecodeTail:
        """_forward, then the decode tail over every token (a decode or verify step's: each token a logits row)."""
        hidden = self._forward(num_tokens, common)
        batch = self.input_batch
        return decode_tail(hidden, self.model.compute_logits(hidden), batch.draft_ids.gpu, batch.positions.gpu,
                           common.query_start_loc, self.num_spec, with_anchors=self.drafter is not None)

    def _graph_for(self, common: CommonAttentionMetadata) -> BatchDescriptor | None:
        """The captured graph this step replays in, or None to run eagerly."""
        if self.graphs is None:
            return None
        n = common.num_reqs
        # numpy views: torch ops on these small host tensors cost microseconds each, on every step
        if common.is_prefilling[:n].numpy().any():
            if self.cudagraph_mode is not CUDAGraphMode.FULL:
                return None
            # A prompt chunk must never replay a bounded decode graph: unbounded (mixed) graphs only.
            return self.dispatcher.dispatch(common.num_actual_tokens, n, None, None)
        lens = np.diff(common.query_start_loc_cpu[:n + 1].numpy())
        uniform = int(lens[0]) if n and (lens == lens[0]).all() else None
        return self.dispatcher.dispatch(common.num_actual_tokens, n, common.max_query_len, uniform)

    def _profile_peak_bytes(self) -> int:
        """Peak device memory of a forward over a full token budget, with caches just big enough for it."""
        if self.device.type != "cuda":
            return 0
        sc = self.config.scheduler_config
        n = min(sc.max_num_batched_tokens, sc.max_model_len)
        blocks = -(-n // self.block_size)
        caches = allocate_layer_caches(self.hf_config, blocks, self.block_size, 1, self.dtype,
                                       self.config.cache_config.mamba_ssm_cache_dtype, self.device,
                                       self.conv_history_major)
        self.model.bind_caches(caches)
        qsl = torch.tensor([0, n], dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=qsl.to(self.device), query_start_loc_cpu=qsl,
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            seq_lens_cpu=torch.tensor([n], dtype=torch.int32), num_reqs=1, num_actual_tokens=n, max_query_len=n,
            max_seq_len=n, block_table=torch.arange(blocks, dtype=torch.int32, device=self.device)[None],
            slot_mapping=torch.arange(n, dtype=torch.int64, device=self.device),
            is_prefilling=torch.tensor([True]), state_indices=torch.zeros(1, dtype=torch.int32, device=self.device),
            state_indices_cpu=torch.zeros(1, dtype=torch.int32))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            hidden = self.model(torch.zeros(n, dtype=torch.long, device=self.device),
                                torch.arange(n, device=self.device), self._attn_metadata(common))
            self.model.compute_logits(hidden[-sc.max_num_seqs:])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        cache_bytes = sum(t.numel() * t.element_size() for c in caches
                          for t in (c.kv_cache, c.conv_state, c.ssm_state) if t is not None)
        del caches, hidden
        torch.cuda.empty_cache()
        return peak - cache_bytes

    def _attn_metadata(self, common: CommonAttentionMetadata) -> HybridAttentionMetadata:
        return HybridAttentionMetadata(kda=self.kda_builder.build(common) if self.kda_builder else None,
                                       mla=self.mla_builder.build(common) if self.mla_builder else None)

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput, kv: KVCacheManager, sampling: SamplingMetadata | None,
                      spec_sampling: SamplingMetadata | None = None,
                      last_step: InFlightStep | None = None) -> AsyncModelRunnerOutput:
        """Queues one step on the device and returns without waiting for it. `sampling` covers the sampling rows
        without drafts, `spec_sampling` the verify rows, each in step order; `last_step`: the device outputs of
        the step launched before, which may still be running (its tokens and drafts continue rows of this one)."""
        common = self.input_batch.prepare(out, kv, last_step)
        trimmed = None
        if self.device_trim_hook is not None and out.scheduled and all(s.draft_token_ids for s in out.scheduled):
            trim = self.device_trim_hook(out, common)
            if trim is not None:
                trimmed, device_lens = trim
                common = self.input_batch.trim_on_device(common, trimmed, device_lens)
        # Taken every step, so that a prediction never outlives its step. The rows' device lengths are the re-cut
        # applied here, whichever hook made it (the seam may be wrapped): they say which slots were verified.
        prediction = self.adaptive_verifier.take_prediction() if self.adaptive_verifier is not None else None
        if prediction is not None and trimmed is not None:
            prediction.device_lens = async_tensor_d2h(device_lens)
        T = common.num_actual_tokens
        desc = self._graph_for(common)
        tail = None
        if desc is None and self.piecewise is not None and T <= self.piecewise.max_size:
            hidden = self.piecewise.run(T, self._attn_metadata(common))
            if self.drafter is not None:
                self.drafter.write_context(T, self.input_batch.positions.gpu, common.slot_mapping)
        elif desc is None:
            hidden = self._forward(T, common)
        else:
            self.input_batch.pad_for_graph(common.num_reqs, T, desc.num_reqs, desc.num_tokens)
            # The graph's outputs are its own buffers, overwritten by its next replay: everything that reads
            # them (this step's host copies and drafts, the next step's in-flight tokens) is queued before that.
            replayed = self.graphs.replay(desc)
            tail = replayed if isinstance(replayed, DecodeTail) else None
            hidden = (replayed.hidden if tail is not None else replayed)[:T]
        result = AsyncModelRunnerOutput(num_tokens=T, recut=trimmed is not None, survival_prediction=prediction)
        ends = common.query_start_loc_cpu[1:].tolist()
        sample_rows = [r for r, s in enumerate(out.scheduled) if s.samples and not s.draft_token_ids]
        verify_rows = [r for r, s in enumerate(out.scheduled) if s.draft_token_ids]
        verified = None
        verified_in_graph = tail is not None and tail.verified is not None and bool(verify_rows) \
            and spec_sampling.all_greedy
        if verified_in_graph:  # the graph verified every row greedily
            verified = tail.verified[:common.num_reqs]
            if len(verify_rows) < common.num_reqs:
                verified = verified[async_tensor_h2d(verify_rows, torch.int64, self.device)]
            self._queue_verified(out, verify_rows, verified, result)
        elif trimmed is not None:  # the device re-cut an all-verify step: every token is a logits row
            verified = self._verify(out, self._logits(hidden, tail, None), verify_rows,
                                    torch.arange(T, device=self.device), common.query_start_loc,
                                    [n - 1 for n in trimmed], spec_sampling, result)
        elif verify_rows:
            drafts = [len(out.scheduled[r].draft_token_ids) for r in verify_rows]
            token_idx = np.concatenate([np.arange(ends[r] - d - 1, ends[r]) for r, d in zip(verify_rows, drafts)])
            cu = np.zeros(len(drafts) + 1, dtype=np.int32)
            np.cumsum(np.add(drafts, 1), out=cu[1:])
            token_idx = async_tensor_h2d(token_idx, torch.int64, self.device)
            verified = self._verify(out, self._logits(hidden, tail, token_idx), verify_rows, token_idx,
                                    async_tensor_h2d(cu, torch.int32, self.device), drafts, spec_sampling, result)
        sampled_in_graph = bool(sample_rows) and tail is not None and sampling.argmax_only
        if sample_rows:
            # None when every token is a row that samples (a decode step): no gather
            idx = None if len(sample_rows) == T else async_tensor_h2d([ends[r] - 1 for r in sample_rows],
                                                                       torch.int64, self.device)
            if sampled_in_graph:  # the graph took the argmax of every token
                result.sampled_token_ids = tail.argmax[:T] if idx is None else tail.argmax[idx]
            else:
                sampled = self.sampler(self._logits(hidden, tail, idx), sampling)
                result.sampled_token_ids = sampled.sampled_token_ids
                if sampled.logprobs is not None:
                    result.logprobs_host = _HostLogprobs.queue(sampled.logprobs)
            result.sampled_host = async_tensor_d2h(result.sampled_token_ids)
            for j, r in enumerate(sample_rows):
                req = out.scheduled[r].request
                result.sample_rows[req.request_id] = j
                k = req.sampling_params.logprobs
                result.sample_logprob_ks.append(self.hf_config.vocab_size if k == -1 else k)
        self._prompt_logprobs(out, hidden, ends, result)
        if self.drafter is not None:
            greedy_anchors = tail is not None and tail.anchor_ids is not None \
                and (sampled_in_graph or not sample_rows) and (verified_in_graph or not verify_rows)
            self._draft(out, common, sample_rows, result.sampled_token_ids, verify_rows, verified,
                        tail if greedy_anchors else None, result)
        if self.device.type == "cuda":
            result.done = torch.cuda.Event()
            result.done.record()
        return result

    def _logits(self, hidden: torch.Tensor, tail: DecodeTail | None, rows: torch.Tensor | None) -> torch.Tensor:
        """Logits of the step's token `rows` (device indices; None: every token): the graph's, or computed now."""
        if tail is not None:
            return tail.logits[:hidden.shape[0]] if rows is None else tail.logits[rows]
        return self.model.compute_logits(hidden if rows is None else hidden[rows])

    def _queue_verified(self, out: SchedulerOutput, rows: list[int], verified: torch.Tensor,
                        result: AsyncModelRunnerOutput) -> None:
        result.verify_rows = [out.scheduled[r].request.request_id for r in rows]
        result.verified = verified
        result.verified_host = async_tensor_d2h(verified)

    def _verify(self, out: SchedulerOutput, logits: torch.Tensor, rows: list[int], token_idx: torch.Tensor,
                cu_num_logits: torch.Tensor, num_draft_tokens: list[int], sampling: SamplingMetadata,
                result: AsyncModelRunnerOutput) -> torch.Tensor:
        """Rejection-sample the verify `rows`; returns their tokens [rows, 1 + K] (accepted, then placeholders).
        token_idx (device) lists each row's tokens in the step (its current token, then its drafts), each one a
        row of `logits`; cu_num_logits (device) cuts them into rows. The drafts are read from the input batch's
        device draft ids (placeholders still -1), so nothing is uploaded again; the host draft counts have the
        device total and only size the output."""
        # index_fill_, not `first[idx] = True`: that assignment copies its scalar from pageable host memory,
        # which makes the host wait for the whole forward before it queues the rest of the step.
        first = torch.zeros(token_idx.shape[0], dtype=torch.bool, device=self.device)
        first.index_fill_(0, cu_num_logits[:-1].long(), True)
        draft_rows = (~first).nonzero_static(size=sum(num_draft_tokens)).squeeze(1)  # no host sync
        drafts = self.input_batch.draft_ids.gpu[token_idx[draft_rows]]
        meta = SpecDecodeMetadata(drafts, num_draft_tokens, cu_num_logits)
        tokens = self.rejection_sampler(logits, None, meta, sampling, max_spec_len=self.num_spec)
        self._queue_verified(out, rows, tokens, result)
        return tokens

    def _draft(self, out: SchedulerOutput, common: CommonAttentionMetadata, sample_rows: list[int],
               sampled: torch.Tensor | None, verify_rows: list[int], verified: torch.Tensor | None,
               greedy_tail: DecodeTail | None, result: AsyncModelRunnerOutput) -> None:
        """DSpark drafts for the requests that sampled this step and may speculate, anchored at their newest
        token: a sampling row's token lands right after the row's last token; a verify row that emitted m tokens
        puts its last m after the row's first. Positions are read on the device, where they are exact (under
        async scheduling the host places a row after every draft in flight). Everything stays on the device.
        `greedy_tail`: the step's graph outputs when every row's tokens are its greedy ones, whose anchors then
        serve a step where every row drafts."""
        picked = [(j, r) for j, r in enumerate(sample_rows) if out.scheduled[r].request.speculate]
        rows = [r for _, r in picked] + verify_rows
        if not rows:
            return
        max_context = max(out.scheduled[r].num_computed_tokens + out.scheduled[r].num_tokens for r in rows)
        n = common.num_reqs
        if greedy_tail is not None and len(rows) == n:
            self._propose(out, range(n), greedy_tail.anchor_ids[:n], greedy_tail.anchor_pos[:n],
                          common.block_table[:n], max_context, result)
            return
        # One upload: the picked rows' indices among the sampled tokens and their last tokens in the step, then
        # each row's step row (its block table; a verify row's first token is at its device offset).
        ends = common.query_start_loc_cpu
        p = len(picked)
        packed = async_tensor_h2d([j for j, _ in picked] + [int(ends[r + 1]) - 1 for _, r in picked] + rows,
                                  torch.int64, self.device)
        step_rows = packed[2 * p:]
        positions = self.input_batch.positions.gpu
        anchors, anchor_pos = [], []
        if picked:
            anchors.append(sampled[packed[:p]])
            anchor_pos.append(positions[packed[p:2 * p]] + 1)
        if verify_rows:
            emitted = (verified != PLACEHOLDER_TOKEN_ID).sum(1)
            anchors.append(verified.gather(1, (emitted - 1)[:, None]).squeeze(1))
            first = common.query_start_loc[step_rows[p:]].long()
            anchor_pos.append(positions[first] + emitted)
        cat = (lambda ts: torch.cat(ts) if len(ts) > 1 else ts[0])
        self._propose(out, rows, cat(anchors), cat(anchor_pos), common.block_table[step_rows], max_context, result)

    def _propose(self, out: SchedulerOutput, rows, anchors: torch.Tensor, positions: torch.Tensor,
                 block_table: torch.Tensor, max_context: int, result: AsyncModelRunnerOutput) -> None:
        self.confidences.before_redraft()
        drafts, confidence = self.drafter.propose(anchors, positions, block_table, max_context,
                                                  # only the device-trim hook (adaptive) reads them
                                                  with_confidence=self.device_trim_hook is not None)
        result.draft_rows = [out.scheduled[r].request.request_id for r in rows]
        result.drafts = drafts
        if confidence is not None:
            # The rows drafted here are the next all-verify step's: its budget may not read their confidences.
            verifier = self.adaptive_verifier
            self.confidences.update(result.draft_rows, confidence, to_host=verifier is None or verifier.can_trim(
                len(result.draft_rows), len(result.draft_rows) * self.num_spec))

    def _prompt_logprobs(self, out: SchedulerOutput, hidden: torch.Tensor, ends: list[int],
                         result: AsyncModelRunnerOutput) -> None:
        for r, s in enumerate(out.scheduled):
            req = s.request
            k = req.sampling_params.prompt_logprobs
            n_prompt = len(req.prompt_token_ids)
            start = s.num_computed_tokens
            if k is None or start >= n_prompt:
                continue
            # Row t predicts prompt token t+1; a chunk covering positions [start, end) scores [start+1, end].
            end = min(start + s.num_tokens, n_prompt - 1)
            if end <= start:
                continue
            rows = hidden[ends[r] - s.num_tokens:ends[r] - s.num_tokens + (end - start)]
            logprobs = self.model.compute_logits(rows).log_softmax(-1)
            targets = async_tensor_h2d(req.prompt_token_ids[start + 1:end + 1], torch.int64, self.device)
            k = logprobs.shape[-1] if k == -1 else k  # -1: the whole vocabulary
            result.prompt_logprobs_host[req.request_id] = _HostLogprobs.queue(gather_logprobs(logprobs, targets, k))
