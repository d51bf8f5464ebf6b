"""Adaptive verification set up on a runner: its gates, and its cost tables timed on the runner's own steps.

The adaptive_verification package says which dummy steps to time and folds the timings (CostProfile); this
module runs them (each step's forward, the draft over its requests, and its re-cut) and builds the verifier.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from vllm.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.spec_decode.adaptive_verification import (AdaptiveVerifier, CostProfile, ProfileBatch, ProfileTimings,
                                                    StepTimes, VerifyCosts)
from vllm.utils import async_tensor_d2h

if TYPE_CHECKING:
    from vllm.worker.model_runner import ModelRunner


def build_adaptive_verifier(runner: ModelRunner) -> tuple[AdaptiveVerifier, StepTimes | None]:
    """The verifier (the runner's device-trim hook) over cost tables measured now, and the step times it reads
    (None off CUDA, where the host runs the forward itself: nothing apart from the tables to weigh)."""
    check_adaptive_gates(runner)
    sc = runner.config.scheduler_config
    costs = profile_step_costs(runner)
    step_times = StepTimes(sc.async_scheduling, costs.verify.padded) if runner.device.type == "cuda" else None
    return AdaptiveVerifier(runner.drafting.confidences, costs, sc.max_num_batched_tokens, step_times), step_times


def check_adaptive_gates(runner: ModelRunner) -> None:
    """Adaptive verification re-cuts verify rows on the device: every target backend must replay any decode shape
    (VARLEN_DECODE or better) and, on a GPU, the step must run in CUDA graphs. (Reading row lengths from the
    device offsets is checked by ModelRunner.set_device_trim_hook.)"""
    flag = "--speculative-config enable_adaptive_verification"
    weak = [f"{type(b).__name__} ({b.cudagraph_support.name})" for b in runner.builders
            if b.cudagraph_support < AttentionCGSupport.VARLEN_DECODE]
    if weak:
        raise ValueError(f"{flag} needs attention backends that replay any decode shape (VARLEN_DECODE or "
                         f"ALWAYS); {', '.join(weak)} cannot; backends: {runner.backend_names}")
    if runner.device.type == "cuda" and runner.graphs.captured is None:
        raise ValueError(f"{flag} runs on CUDA graphs on a GPU (cudagraph_mode is {runner.cudagraph_mode.value}); "
                         "drop --enforce-eager")


@torch.inference_mode()
def profile_step_costs(runner: ModelRunner) -> VerifyCosts:
    """The cost tables: each dummy step the profile asks for runs its forward, the draft over its requests, and
    its re-cut, `profile.repeats` times."""
    sc = runner.config.scheduler_config
    profile = CostProfile(runner.num_spec, sc.max_num_seqs, sc.max_num_batched_tokens, sc.max_model_len,
                          sorted({d.num_tokens for d in runner.graphs.descriptors}))
    samples = []
    for batch in profile.batches_to_profile():
        common, _, run = runner.dummy_decode_step(batch.num_tokens, batch.context)
        verify = timed(runner.device, run, profile.repeats)
        zeros = torch.zeros(batch.num_reqs, dtype=torch.int64, device=runner.device)
        draft = timed(runner.device, functools.partial(runner.drafter.propose, zeros, zeros,
                                                       common.block_table[:batch.num_reqs], batch.context,
                                                       with_confidence=True), profile.repeats)
        samples.append((batch, ProfileTimings(verify, draft, _timed_recut(runner, profile, batch))))
    return profile.set_initial_cost_curves(samples)


def _timed_recut(runner: ModelRunner, profile: CostProfile, batch: ProfileBatch) -> list[float]:
    """Timings of what a trimmed step runs besides its graph, as execute_model runs it: the package's re-cut of
    the batch, the input batch's trim and the copy of its row lengths. Each on a fresh dummy step (the re-cut
    shortens its rows), after one untimed run."""
    recut = profile.recut_dummy(batch, runner.device)

    def run(common: CommonAttentionMetadata) -> None:
        host, device_lens = recut.lengths()
        runner.input_batch.trim_on_device(common, host, device_lens)
        async_tensor_d2h(device_lens)
    times = []
    for _ in range(profile.repeats + 1):
        common, _, _ = runner.dummy_decode_step(batch.num_tokens, batch.context)
        times += timed(runner.device, functools.partial(run, common), 1)
    return times[1:]


def timed(device: torch.device, fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall seconds of each of `repeats` runs of fn, the device synchronised around each."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times
