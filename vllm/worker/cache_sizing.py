"""How many MLA blocks and KDA state slots fit in the memory budget.

On CUDA the budget is `gpu_memory_utilization * total` minus what other processes hold, the weights and the
profiled activation peak; on CPU (or with --kv-cache-memory-bytes) it is given. State slots are sized first
(one per running request, or 1 + num_speculative_tokens checkpoint slots with speculation, up to max_num_seqs
requests, at most half the budget), blocks take the rest, up to what max_num_seqs requests of max_model_len
tokens can use.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vllm.attention.backend import CommonAttentionMetadata
from vllm.attention.kda.recover import record_bytes
from vllm.config import VllmConfig
from vllm.distributed.communication_op import min_over_ranks
from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size

logger = logging.getLogger(__name__)

CPU_SNAPSHOTS = 64  # default KDA snapshot slots on a CPU (see plan_cache)


@dataclass(slots=True, frozen=True)
class CacheLayout:
    num_blocks: int
    num_state_slots: int
    block_bytes: int  # all MLA layers (and a DSpark draft's context caches), one block
    slot_bytes: int  # all KDA layers, one request's conv + recurrent state
    budget_bytes: int
    num_snapshot_slots: int = 0  # KDA state snapshots for prefix caching, in slots after the requests' ones
    record_bytes: int = 0  # all KDA layers, one request slot's RecoverSSM records (snapshot slots have none)


def per_unit_bytes(config: VllmConfig) -> tuple[int, int]:
    hf, cc = config.model_config.hf_config, config.cache_config
    act = torch.empty((), dtype=config.model_config.dtype).element_size()
    state = torch.empty((), dtype=cc.mamba_ssm_cache_dtype).element_size()
    block = len(hf.mla_layers) * cc.block_size * hf.mla_cache_dim * act
    spec = config.speculative_config
    if spec is not None and spec.draft_config is not None:  # DSpark's context caches share the MLA blocks
        block += spec.draft_config.num_hidden_layers * cc.block_size * spec.draft_config.mla_cache_dim * act
    tp = get_tensor_model_parallel_world_size()  # a rank holds its own heads' states
    conv_h, conv_w = hf.kda_conv_state_shape(tp_size=tp)
    H, V, K = hf.kda_ssm_state_shape(tp)
    slot = len(hf.kda_layers) * (conv_h * conv_w * act + H * V * K * state)
    return block, slot


def per_request_record_bytes(config: VllmConfig, record_len: int | None = None) -> int:
    """RecoverSSM's records of one request slot over all KDA layers (0 without it), for `record_len` tokens
    (None: the configured 1 + K, or 0 when RecoverSSM is off)."""
    hf = config.model_config.hf_config
    Q = config.recover_record_len if record_len is None else record_len
    if not Q or not hf.kda_layers:
        return 0
    tp = get_tensor_model_parallel_world_size()
    H, _, K = hf.kda_ssm_state_shape(tp)
    return len(hf.kda_layers) * record_bytes(H, K, hf.kda_conv_state_shape(tp_size=tp)[0], Q,
                                             config.model_config.dtype)


def speculating_state_bytes(config: VllmConfig) -> tuple[int, int]:
    """KDA state memory of one speculating request: (as 1 + K checkpoint columns, under RecoverSSM)."""
    _, slot = per_unit_bytes(config)
    Q = 1 + config.num_speculative_tokens
    return Q * slot, slot + per_request_record_bytes(config, Q)


def cache_budget(config: VllmConfig, activation_peak_bytes: int, graph_bytes: int = 0) -> int:
    """The bytes the cache pools may take: given (CPU, --kv-cache-memory-bytes), else the device's share minus
    other processes, the weights and activation peak, and the CUDA graphs' memory pool."""
    cc = config.cache_config
    if cc.kv_cache_memory_bytes is not None:
        return cc.kv_cache_memory_bytes
    device = config.model_config.device
    free, total = torch.cuda.mem_get_info(device)
    others = total - free - torch.cuda.memory_reserved(device)
    weights = torch.cuda.memory_allocated(device)
    return int(total * cc.gpu_memory_utilization) - others - max(activation_peak_bytes, weights) - graph_bytes


def plan_cache(config: VllmConfig, activation_peak_bytes: int, graph_bytes: int = 0) -> CacheLayout:
    cc, sc = config.cache_config, config.scheduler_config
    block_bytes, slot_bytes = per_unit_bytes(config)
    budget = min_over_ranks(cache_budget(config, activation_peak_bytes, graph_bytes))  # the ranks must agree
    slots = 0
    per_request = config.state_slots_per_request
    records = per_request_record_bytes(config)
    if slot_bytes:
        # +1: the null slot (kv_cache_manager.NULL_STATE_SLOT), which padding rows point at.
        slots = min(sc.max_num_seqs * per_request + 1, max(budget // 2, 0) // (slot_bytes + records))
        if slots < 1 + per_request:
            raise ValueError(f"the cache budget ({budget / 2**20:.1f} MiB) cannot hold one request's KDA state "
                             f"({per_request} x {(slot_bytes + records) / 2**20:.1f} MiB); raise "
                             "--gpu-memory-utilization or "
                             "--kv-cache-memory-bytes, use --mamba-ssm-cache-dtype bfloat16, or lower "
                             "num_speculative_tokens")
    snapshots = 0
    if slot_bytes and cc.enable_prefix_caching:
        # By default 4 per request the batch can hold, at most a quarter of the budget: a conversation's next
        # turn needs one, a shared prompt one more, and LRU keeps the rest for who comes back. On a CPU at most
        # CPU_SNAPSHOTS: its batches are small, and every state pool grows by the snapshot slots.
        default = min(4 * sc.max_num_seqs, max(budget // 4, 0) // slot_bytes)
        if config.model_config.device.type == "cpu":
            default = min(default, CPU_SNAPSHOTS)
        snapshots = cc.num_kda_snapshots if cc.num_kda_snapshots is not None else default
    needed = -(-sc.max_model_len // cc.block_size) if block_bytes else 0
    if cc.num_gpu_blocks_override is not None:
        blocks = cc.num_gpu_blocks_override
    else:
        # More blocks than max_num_seqs full-length requests can ever hold would be memory nobody uses.
        blocks = min((budget - (slots + snapshots) * slot_bytes - slots * records) // block_bytes,
                     sc.max_num_seqs * needed) \
            if block_bytes else 0
    if blocks < needed:
        raise ValueError(f"the MLA cache holds {blocks} blocks = {blocks * cc.block_size} tokens, fewer than one "
                         f"request of --max-model-len={sc.max_model_len}; lower --max-model-len or give the cache "
                         "more memory (--gpu-memory-utilization, --kv-cache-memory-bytes, --num-gpu-blocks-override)")
    layout = CacheLayout(blocks, slots, block_bytes, slot_bytes, budget, snapshots, records)
    mib = 2**20
    spec = ""
    if config.num_speculative_tokens and slot_bytes:
        columns, recover = speculating_state_bytes(config)
        mode = "RecoverSSM" if cc.use_replayssm else "checkpoint columns"
        spec = (f"; {mode}: {slots // per_request} speculating requests, KDA state per speculating request "
                f"{(recover if cc.use_replayssm else columns) / mib:.2f} MiB (checkpoint columns "
                f"{columns / mib:.2f} MiB, RecoverSSM {recover / mib:.2f} MiB)")
    logger.info("cache capacity: %d MLA tokens (%d blocks x %d, %.1f MiB), %d KDA state slots (%.1f MiB), %d KDA "
                "snapshot slots for prefix caching (%.1f MiB); %.2f MiB per state (%s); budget %.1f MiB, activation "
                "peak %.1f MiB, CUDA graphs %.1f MiB%s", blocks * cc.block_size, blocks, cc.block_size,
                blocks * block_bytes / mib, slots, slots * (slot_bytes + records) / mib, snapshots,
                snapshots * slot_bytes / mib, slot_bytes / mib, str(cc.mamba_ssm_cache_dtype).removeprefix("torch."),
                budget / mib, activation_peak_bytes / mib, graph_bytes / mib, spec)
    return layout


@torch.inference_mode()
def profile_peak_bytes(config: VllmConfig, model: torch.nn.Module, bind_caches: Callable[[int], list],
                       attn_metadata: Callable[[CommonAttentionMetadata], object], input_batch) -> int:
    """Peak device memory of the largest step, less its caches: a full token budget as one new prompt (its last
    max_num_seqs rows' logits), with caches just big enough for it (`bind_caches(num_blocks)` binds them and
    returns them); and, on the runner's `input_batch`, the same budget as the last chunk of a max_model_len
    prompt, whose MLA prefill decompresses every earlier position (unabsorbed attention: GiBs at long contexts,
    which a new prompt alone never shows). 0 off CUDA."""
    device = config.model_config.device
    if device.type != "cuda":
        return 0
    sc = config.scheduler_config
    n = min(sc.max_num_batched_tokens, sc.max_model_len)
    blocks = -(-n // config.cache_config.block_size)
    caches = bind_caches(blocks)
    qsl = torch.tensor([0, n], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl,
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        seq_lens_cpu=torch.tensor([n], dtype=torch.int32), num_reqs=1, num_actual_tokens=n, max_query_len=n,
        max_seq_len=n, block_table=torch.arange(blocks, dtype=torch.int32, device=device)[None],
        slot_mapping=torch.arange(n, dtype=torch.int64, device=device),
        is_prefilling=torch.tensor([True]), state_indices=torch.zeros(1, dtype=torch.int32, device=device),
        state_indices_cpu=torch.zeros(1, dtype=torch.int32))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    hidden = model(torch.zeros(n, dtype=torch.long, device=device), torch.arange(n, device=device),
                   attn_metadata(common))
    model.compute_logits(hidden[-sc.max_num_seqs:])
    del hidden
    if sc.max_model_len > n:
        last_chunk_forward(model, input_batch, attn_metadata, n, sc.max_model_len - n)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    cache_bytes = sum(t.numel() * t.element_size() for c in caches.layers for t in (c.kv_cache,) if t is not None)
    if caches.kda is not None:
        rec = caches.kda.records
        cache_bytes += sum(t.numel() * t.element_size() for t in (caches.kda.conv_state, caches.kda.ssm_state,
                                                                   *((rec.c, rec.kd, rec.x) if rec else ())))
    del caches
    torch.cuda.empty_cache()
    return peak - cache_bytes


def last_chunk_forward(model: torch.nn.Module, input_batch, attn_metadata: Callable[[CommonAttentionMetadata], object],
                       num_tokens: int, context: int) -> torch.Tensor:
    """The forward of a prompt chunk of `num_tokens` after `context` cached positions, on harmless inputs
    (InputBatch.fill_dummy: contexts read from block 0, no cache writes, the null state slot), so any bound
    caches will do. Its hidden states."""
    input_batch.fill_dummy(np.array([num_tokens]), np.array([context]), np.array([True]))
    common = input_batch.dummy_metadata(1, num_tokens, num_tokens, num_tokens + context)
    return model(input_batch.input_ids.gpu[:num_tokens], input_batch.positions.gpu[:num_tokens],
                 attn_metadata(common))
