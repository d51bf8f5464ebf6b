"""ModelRunner: SchedulerOutput -> inputs -> CommonAttentionMetadata -> forward -> logits -> sampled tokens.

It owns what every model needs: the model, the cache pools (sized after loading: cache_sizing.py), the
persistent input buffers (input_batch.py), the step's graphs (graphs.py), the per-request sampling state
(sampling_state.py), the step after the forward (sample_step.py: one logits pass, then verification, sampling and
prompt logprobs) and the drafts (drafting.py). Adaptive verification is set up in verify_costs.py.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Iterable

import numpy as np
import torch

from vllm.attention.backend import CommonAttentionMetadata, HybridAttentionMetadata, LayerShapes
from vllm.attention.selector import select_backends
from vllm.config import VllmConfig
from vllm.core.kv_cache_manager import KVCacheManager
from vllm.core.request import Request
from vllm.core.scheduler import SchedulerOutput
from vllm.model_executor.model_loader import load_model
from vllm.model_executor.models.kimi_k3.model import LayerCaches, allocate_layer_caches
from vllm.sample.grammar_bitmask import GrammarBitmask
from vllm.spec_decode.adaptive_verification import AdaptiveVerifier, StepTimes
from vllm.utils import async_tensor_d2h
from vllm.worker.cache_sizing import CacheLayout, plan_cache, profile_peak_bytes
from vllm.worker.cudagraph import BatchDescriptor
from vllm.worker.decode_tail import DecodeTail, decode_tail
from vllm.worker.drafting import Drafting, load_dspark
from vllm.worker.graphs import StepGraphs, choose_mode
from vllm.worker.input_batch import InputBatch
from vllm.worker.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from vllm.worker.sample_step import SampleStep
from vllm.worker.sampling_state import SamplingState
from vllm.worker.snapshots import StateSnapshots
from vllm.worker.state_commit import StateCommit
from vllm.worker.verify_costs import build_adaptive_verifier
from vllm.worker.warmup import eager_warmup_steps

logger = logging.getLogger(__name__)

# (scheduled step, its metadata) -> (row lengths the host shows, device int32 row lengths the kernels run), or
# None to run the step as scheduled
DeviceTrimHook = Callable[[SchedulerOutput, CommonAttentionMetadata], tuple[list[int], torch.Tensor] | None]


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
                             block_size=cc.block_size, num_speculative_tokens=config.num_speculative_tokens,
                             recover_ssm=cc.use_replayssm)
        backends = select_backends(config.kernel_config, self.device, self.dtype, shapes)
        self.backend_names = (f"MLA {backends.mla.name}, KDA prefill {backends.kda.prefill.name}, "
                              f"KDA decode {backends.kda.decode.name}")
        logger.info("attention backends: %s", self.backend_names)
        self.model = load_model(mc.model, self.dtype, self.device, backends, hf, mc.load_format, mc.seed)
        self.hf_config = hf
        self.block_size = cc.block_size
        self.kda_builder = backends.kda.builder(self.block_size, config.recover_record_len) if hf.kda_layers else None
        self.kda_prefill_backend = backends.kda.prefill
        self.conv_history_major = backends.kda.conv_state_history_major
        self.mla_builder = backends.mla.builder(self.block_size) if hf.mla_layers else None
        self.builders = [b for b in (self.kda_builder, self.mla_builder) if b is not None]
        self.num_spec = config.num_speculative_tokens
        self.drafter = load_dspark(config, self.model)  # the DSpark draft model, if any
        self.drafting = Drafting(config, self.drafter)
        self.sampling = SamplingState(hf.vocab_size, self.device)
        self.layout: CacheLayout | None = None
        self.cudagraph_mode = choose_mode(config, self.device, self.builders, hf.attn_res_block_size is not None)
        self.device_trim_hook: DeviceTrimHook | None = None
        self.adaptive_verifier: AdaptiveVerifier | None = None  # the device-trim hook of adaptive verification
        # Adaptive verification's measured all-verify steps: the engine hands them over, the budget reads them.
        self.step_times: StepTimes | None = None

    def set_device_trim_hook(self, hook: DeviceTrimHook | None) -> None:
        """Installs the adaptive-verification seam: on a step where every row verifies drafts, the hook gets
        the scheduled step and its metadata and returns (cpu_lens, device_lens): new row lengths (each
        1..scheduled, same total) as the host metadata shows them and as the device runs them, or None to run
        the step as scheduled. Only backends that take row lengths from the device offsets can run such steps."""
        unable = [type(b).__name__ for b in self.builders if not b.supports_device_cpu_query_lens_mismatch()]
        if hook is not None and unable:
            raise ValueError(f"trimming drafts on the device needs attention backends that read row lengths from "
                             f"the device offsets; {', '.join(unable)} read the host copies")
        self.device_trim_hook = hook

    # ---- what the engine calls ---------------------------------------------------------------------------------
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

    def propose_drafts(self, running: Iterable[Request], launched: AsyncModelRunnerOutput | None = None) -> None:
        """Each running request's drafts for its next step (Drafting.propose_drafts)."""
        self.drafting.propose_drafts(running, launched)

    def remove_finished(self, alive: Container[str]) -> None:
        """Forgets the per-request state of requests that are no longer alive."""
        self.sampling.remove_finished(alive)

    # ---- set-up -----------------------------------------------------------------------------------------------
    def initialize_cache(self) -> KVCacheManager:
        """Sizes and allocates the cache pools after a profile run (and, with CUDA graphs, a trial capture that
        measures their memory pool), binds them, captures the graphs, returns the pools' manager."""
        sc = self.config.scheduler_config
        max_blocks = -(-sc.max_model_len // self.block_size)
        self.input_batch = InputBatch(sc.max_num_seqs, sc.max_num_batched_tokens, max_blocks, self.block_size,
                                      self.device, slots_per_request=self.config.state_slots_per_request,
                                      speculating=self.num_spec > 0)
        self.graphs = StepGraphs(self.config, self.device, self.cudagraph_mode, self.backend_names, self.model,
                                 self.input_batch, self.drafter, self._forward, self._forward_with_tail,
                                 self._attn_metadata)
        self.sample_step = SampleStep(self.model.compute_logits, self.input_batch.draft_ids.gpu, self.num_spec,
                                      self.hf_config.vocab_size, self.device)
        peak = profile_peak_bytes(self.config, self.model, lambda n: self._bind_caches(n, 1, draft=False),
                                  self._attn_metadata, self.input_batch)
        graph_bytes = self.graphs.measure_bytes(lambda n: self._bind_caches(n, 1))
        self.layout = lay = plan_cache(self.config, peak, graph_bytes)
        caches = self._bind_caches(lay.num_blocks, lay.num_state_slots + lay.num_snapshot_slots,
                                   record_slots=lay.num_state_slots)
        kda, recover = caches.kda, self.config.cache_config.use_replayssm
        self.snapshots = StateSnapshots([kda.conv_state, kda.ssm_state] if kda is not None else [], self.device,
                                        recover=recover)
        self.state_commit = StateCommit(kda.conv_state, kda.ssm_state, kda.records, self.device) \
            if recover and kda is not None else None
        kv = KVCacheManager(lay.num_blocks, self.block_size, lay.num_state_slots,
                            needs_blocks=bool(self.hf_config.mla_layers) or self.drafter is not None,
                            needs_slots=bool(self.hf_config.kda_layers),
                            slots_per_request=self.config.state_slots_per_request,
                            enable_prefix_caching=self.config.cache_config.enable_prefix_caching,
                            snapshot_slots=range(lay.num_state_slots, lay.num_state_slots + lay.num_snapshot_slots))
        self.graphs.capture(graph_bytes)
        if self.device.type == "cuda":  # elsewhere nothing compiles (torch kernels, or Triton's interpreter)
            self.warm_up_eager_steps()
        spec = self.config.speculative_config
        if spec is not None and spec.enable_adaptive_verification:
            self.adaptive_verifier, self.step_times = build_adaptive_verifier(self)
            self.set_device_trim_hook(self.adaptive_verifier)
        return kv

    def _bind_caches(self, num_blocks: int, num_slots: int, draft: bool = True,
                     record_slots: int | None = None) -> LayerCaches:
        """Allocates the layers' cache pools (and, with `draft`, the DSpark draft's) and binds them; RecoverSSM's
        records for the first `record_slots` slots (None: all)."""
        cc = self.config.cache_config
        caches = allocate_layer_caches(self.hf_config, num_blocks, self.block_size, num_slots, self.dtype,
                                       cc.mamba_ssm_cache_dtype, self.device, self.conv_history_major,
                                       self.config.recover_record_len, record_slots)
        self.model.bind_caches(caches)
        if draft and self.drafter is not None:
            self.drafter.allocate_caches(num_blocks, self.block_size)
        return caches

    @torch.inference_mode()
    def warm_up_eager_steps(self) -> None:
        """One eager forward of each step shape in `warmup.eager_warmup_steps`, over harmless inputs (no cache
        writes, the null state slot), so that their kernels compile now and not under the first requests."""
        sc = self.config.scheduler_config
        # The lengths where the backends switch kernels, as they declare them (None: no such switch).
        short = self.mla_builder.prefill_min_query_len if self.mla_builder is not None else None
        recurrent = self.kda_prefill_backend.recurrent_prefill_max_len
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
        desc = self.graphs.graph_for(common)
        if desc is None:
            return common, None, lambda: self._forward(num_tokens, common)
        self.input_batch.pad_for_graph(n_reqs, num_tokens, desc.num_reqs, desc.num_tokens)
        return common, desc, lambda: self.graphs.captured.replay(desc)

    # ---- the step ---------------------------------------------------------------------------------------------
    def _attn_metadata(self, common: CommonAttentionMetadata, capturing: bool = False) -> HybridAttentionMetadata:
        """The backends' metadata; `capturing`: built inside a graph's capture (build_for_capture)."""
        kda, mla = self.kda_builder, self.mla_builder
        if capturing:
            return HybridAttentionMetadata(kda=kda.build_for_capture(common) if kda else None,
                                           mla=mla.build_for_capture(common) if mla else None)
        return HybridAttentionMetadata(kda=kda.build(common) if kda else None, mla=mla.build(common) if mla else None)

    def _forward(self, num_tokens: int, common: CommonAttentionMetadata, capturing: bool = False) -> torch.Tensor:
        """The target's forward, then (with a DSpark draft) the step's context into the draft's caches: both in
        one graph where the step replays one."""
        batch = self.input_batch
        hidden = self.model(batch.input_ids.gpu[:num_tokens], batch.positions.gpu[:num_tokens],
                            self._attn_metadata(common, capturing))
        if self.drafter is not None:
            self.drafter.write_context(num_tokens, batch.positions.gpu, common.slot_mapping)
        return hidden

    def _forward_with_tail(self, num_tokens: int, common: CommonAttentionMetadata,
                           capturing: bool = False) -> DecodeTail:
        """_forward, then the decode tail over every token (a decode or verify step's: each token a logits row)."""
        hidden = self._forward(num_tokens, common, capturing)
        batch = self.input_batch
        return decode_tail(hidden, self.model.compute_logits(hidden), batch.draft_ids.gpu, batch.positions.gpu,
                           common.query_start_loc, self.num_spec, with_anchors=self.drafter is not None)

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput, kv: KVCacheManager, last: AsyncModelRunnerOutput | None = None,
                      last_landed: bool = True,
                      before_sampling: Callable[[], GrammarBitmask | None] | None = None) -> AsyncModelRunnerOutput:
        """Queues one step on the device and returns without waiting for it. `last`: the step launched before,
        which may still be running (its tokens and drafts continue rows of this one); `last_landed`: whether its
        outputs have reached the requests already. `before_sampling`: called once the forward is queued, it
        returns the structured-output masks of the sampling rows (vllm/structured_output/manager.py)."""
        in_flight = None if last is None or last_landed else last.in_flight_tokens
        rows = out.scheduled
        sampling = self.sampling.metadata([s.request for s in rows if s.samples and not s.draft_token_ids],
                                          in_flight, "sample")
        spec_sampling = self.sampling.metadata([s.request for s in rows if s.draft_token_ids], in_flight, "verify")
        common = self.input_batch.prepare(out, kv, last.in_flight_step if last is not None else None)
        trimmed = None
        if self.device_trim_hook is not None and rows and all(s.draft_token_ids for s in rows):
            trim = self.device_trim_hook(out, common)
            if trim is not None:
                trimmed, device_lens = trim
                common = self.input_batch.trim_on_device(common, trimmed, device_lens)
        # Taken every step, so that a prediction never outlives its step. The rows' device lengths are the re-cut
        # applied here, whichever hook made it (the seam may be wrapped): they say which slots were verified.
        prediction = self.adaptive_verifier.take_prediction() if self.adaptive_verifier is not None else None
        if prediction is not None and trimmed is not None:
            prediction.device_lens = async_tensor_d2h(device_lens)
        self.snapshots.restore(out.restores)  # prefix cache hits' states, before the forward reads them
        hidden, tail = self.graphs.run(common)
        grammar = before_sampling() if before_sampling is not None else None
        result = AsyncModelRunnerOutput(num_tokens=common.num_actual_tokens, recut=trimmed is not None,
                                        survival_prediction=prediction)
        draft_probs = None
        if last is not None and last.draft_probs is not None and spec_sampling is not None \
                and not spec_sampling.all_greedy:
            draft_probs = self.drafting.draft_probs_for(out, last)
        tokens = self.sample_step(out, common, hidden, tail, sampling, spec_sampling, trimmed, result, draft_probs,
                                  grammar)
        saved, decode_saves = self.snapshots.save(out.saves, common, self.input_batch.positions.gpu, tokens)
        if self.state_commit is not None:  # RecoverSSM: the rows' kept tokens into their states
            self.state_commit(common, tokens, decode_saves)
        if saved is not None:
            result.snapshots_saved_host = async_tensor_d2h(saved)
        if self.drafter is not None:
            verifier = self.adaptive_verifier
            self.drafting.draft_on_device(out, common, tokens, tail, self.input_batch.positions.gpu,
                                          # only the device-trim hook (adaptive) reads the confidences
                                          self.device_trim_hook is not None,
                                          verifier.can_trim if verifier is not None else None, result)
        if self.device.type == "cuda":
            result.done = torch.cuda.Event()
            result.done.record()
        return result
