"""KDA metadata: one step's requests split into a decode group and a prefill group, each run by its backend.

Decode rows (requests past their prompt, 1..K+1 tokens each) and prompt chunks run different kernels, chosen
separately (`--kda-decode-backend`, `--kda-prefill-backend`). A step whose rows are all decodes — the
common case, and the only one a decode CUDA graph replays — passes the runner's device tensors straight to
the decode kernel (no host work, no gather). A mixed step gathers each group's tokens with index tensors
made on the host; such a step contains a prefill and never replays a decode graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from vllm.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionMetadataBuilder,
                                    CommonAttentionMetadata, QueryLenSupport)
from vllm.attention.kda.recover import KDARecords
from vllm.utils import async_tensors_h2d


class KDAWeights(Protocol):
    """What a KDA backend reads from the layer (see models/kimi_k3/kda.py)."""
    num_heads: int
    head_dim: int
    gate_lower_bound: float | None
    conv_weight: torch.Tensor  # [3P, W], q/k/v channels stacked
    A_log: torch.Tensor  # [H] float32
    dt_bias: torch.Tensor  # [P] float32
    o_norm: Any  # RMSNormGated: .weight [K], .eps, called as o_norm(x, gate)


def gated_norm(layer: KDAWeights, core: torch.Tensor, output_gate: torch.Tensor,
               act_dtype: torch.dtype) -> torch.Tensor:
    """The layer's gated RMSNorm of the core output [T, H, V] (rounded to the activation dtype first, as the
    kernels store it) with output_gate [T, P]; returns [T, P]."""
    return layer.o_norm(core.to(act_dtype), output_gate.unflatten(-1, (layer.num_heads, -1))).flatten(-2)


@dataclass(slots=True)
class KDARows:
    """A group of requests one KDA kernel runs, over the group's own tokens (gathered if needed)."""
    query_start_loc: torch.Tensor  # device int32 [N+1] over the group's tokens (cum_seq_lens_q)
    query_start_loc_cpu: torch.Tensor  # cpu int32 [N+1]
    # device int32 [N]: state slot per request; or, for decode rows under speculative decoding, [N, 1 + K]
    # checkpoint columns: read the state at column num_accepted_tokens - 1, write token t's state to column t.
    state_indices: torch.Tensor
    state_indices_cpu: torch.Tensor
    has_initial_state: torch.Tensor  # device bool [N]: False for a fresh prompt (zero history)
    has_initial_state_cpu: torch.Tensor
    num_reqs: int
    num_tokens: int
    max_query_len: int  # a promised bound, not re-measured
    token_idx: torch.Tensor | None = None  # device long [num_tokens]: positions in the step; None = all, in order
    num_accepted_tokens: torch.Tensor | None = None  # device int32 [N], with 2-D state_indices
    # RecoverSSM: decode rows read their slot's state, write per-token records instead of it (recover.py)
    record: bool = False
    _offsets_int64: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def checkpointed(self) -> bool:
        return self.state_indices.dim() == 2

    def offsets_int64(self) -> tuple[torch.Tensor, torch.Tensor]:
        """query_start_loc as int64 (device, host), made once per step and shared by every layer: fla caches its
        chunk bookkeeping by the offsets' identity, and a fresh .long() per layer redid it (with a blocking
        host-to-device copy) in every KDA layer."""
        if self._offsets_int64 is None:
            self._offsets_int64 = (self.query_start_loc.long(), self.query_start_loc_cpu.long())
        return self._offsets_int64


@dataclass(slots=True)
class KDAMetadata:
    decode: KDARows | None
    prefill: KDARows | None
    num_tokens: int


class KDABackend(AttentionBackend):
    """A KDA kernel family. It runs decode rows, prefill rows or both.

    Both entry points take the group's tokens only — mixed_qkv [T, 3P] (pre-conv), raw_gate [T, P],
    raw_beta [T, H], output_gate [T, P] — update conv_state [slots, 3P, W-1] and ssm_state [slots, H, V, K]
    in place, and return the gated-normalised core output [T, P] in the activation dtype. The inputs' last dim
    is contiguous but their rows may be strided (column slices of the model's one projection GEMM): a backend
    whose library assumes contiguous rows makes them so (tests/attention's harness feeds them strided).
    """
    runs_prefill: ClassVar[bool] = False
    runs_decode: ClassVar[bool] = False
    # Which decode batches its decode path can replay in a CUDA graph (prefill rows are never captured).
    decode_cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    # Whether its decode path writes checkpoint columns (2-D state_indices + num_accepted_tokens), which
    # speculative decoding needs.
    decode_checkpoints: ClassVar[bool] = False
    # Whether its decode path can leave RecoverSSM's per-token records (rows.record) instead of writing the state.
    decode_records: ClassVar[bool] = False
    # Whether its decode path takes row lengths from the device offsets only (never the host copies), so
    # the device may trim rows after the host metadata was built.
    decode_reads_device_offsets: ClassVar[bool] = False
    # Whether its decode kernel needs conv-state pools stored history-major (strides [slot, 1, 3P]); every
    # backend reads either layout through strides, so the decode backend picks the pool's layout.
    conv_state_history_major: ClassVar[bool] = False
    # Prompt chunks up to this many tokens run its prefill through another kernel than longer ones (the start-up
    # warm-up crosses it); None: one kernel for every length.
    recurrent_prefill_max_len: ClassVar[int | None] = None

    @classmethod
    def builder(cls, block_size: int) -> AttentionMetadataBuilder:
        raise TypeError(f"{cls.name} is one half of a KDA pair; build metadata with KDAAttention")

    @classmethod
    def forward_decode(cls, layer: KDAWeights, mixed_qkv: torch.Tensor, raw_gate: torch.Tensor,
                       raw_beta: torch.Tensor, output_gate: torch.Tensor, conv_state: torch.Tensor,
                       ssm_state: torch.Tensor, rows: KDARows) -> torch.Tensor:
        raise NotImplementedError(f"{cls.name} has no decode path")

    @classmethod
    def forward_prefill(cls, layer: KDAWeights, mixed_qkv: torch.Tensor, raw_gate: torch.Tensor,
                        raw_beta: torch.Tensor, output_gate: torch.Tensor, conv_state: torch.Tensor,
                        ssm_state: torch.Tensor, rows: KDARows) -> torch.Tensor:
        raise NotImplementedError(f"{cls.name} has no prefill path")


class KDAMetadataBuilder(AttentionMetadataBuilder):
    query_len_support = QueryLenSupport.VARLEN

    def __init__(self, decode: type[KDABackend], record_len: int = 0) -> None:
        # The prefill kernels take per-chunk host decisions (chunk counts, gathers), so a batch with a prompt chunk
        # never replays: the pair's support is its decode backend's, at most VARLEN_DECODE.
        self.cudagraph_support = min(decode.decode_cudagraph_support, AttentionCGSupport.VARLEN_DECODE)
        self.decode_reads_device_offsets = decode.decode_reads_device_offsets
        self.record_len = record_len  # RecoverSSM's tokens per verify row (0: off)

    def supports_device_cpu_query_lens_mismatch(self) -> bool:
        # An all-decode step hands the device offsets to the decode kernel; a step with a prompt chunk is
        # built on the host and never trimmed.
        return self.decode_reads_device_offsets

    def build(self, common: CommonAttentionMetadata) -> KDAMetadata:
        """Rows split by request state. With checkpoint columns (speculative decoding) every decode row, drafts
        or not, takes the checkpointed path, so a graph captured on 1-token rows replays ragged rows; prefill
        rows read and write column 0 (a prefilling request has kept exactly one token's state)."""
        n, T = common.num_reqs, common.num_actual_tokens
        prefilling = common.is_prefilling[:n].numpy()
        if not prefilling.any():
            return KDAMetadata(decode=self._recording(self._whole(common, decode=True)), prefill=None, num_tokens=T)
        if prefilling.all():
            return KDAMetadata(decode=None, prefill=self._whole(common, decode=False), num_tokens=T)
        qsl = common.query_start_loc_cpu[:n + 1].numpy()
        return KDAMetadata(decode=self._recording(_gather_rows(common, qsl, ~prefilling, decode=True)),
                           prefill=_gather_rows(common, qsl, prefilling, decode=False), num_tokens=T)

    def _recording(self, rows: KDARows) -> KDARows:
        """Under RecoverSSM, decode rows record instead of writing the state; rows longer than the records
        (adaptive verification's profiling dummies) take the plain path."""
        rows.record = 0 < rows.max_query_len <= self.record_len
        return rows

    @staticmethod
    def _whole(common: CommonAttentionMetadata, decode: bool) -> KDARows:
        n = common.num_reqs
        has_init_cpu = common.num_computed_tokens_cpu[:n] > 0
        slots, slots_cpu, accepted = _slots(common, decode)
        return KDARows(
            query_start_loc=common.query_start_loc[:n + 1], query_start_loc_cpu=common.query_start_loc_cpu[:n + 1],
            state_indices=slots[:n], state_indices_cpu=slots_cpu[:n],
            has_initial_state=(common.seq_lens[:n] > common.query_start_loc[1:n + 1] - common.query_start_loc[:n]),
            has_initial_state_cpu=has_init_cpu, num_reqs=n, num_tokens=common.num_actual_tokens,
            max_query_len=common.max_query_len, num_accepted_tokens=None if accepted is None else accepted[:n])


def _slots(common: CommonAttentionMetadata, decode: bool):
    """(slots, slots_cpu, num_accepted or None) for a decode or a prefill group of the whole step."""
    if common.state_indices.dim() == 1:
        return common.state_indices, common.state_indices_cpu, None
    if decode:
        return common.state_indices, common.state_indices_cpu, common.num_accepted_tokens
    return common.state_indices[:, 0].contiguous(), common.state_indices_cpu[:, 0].contiguous(), None


def _gather_rows(common: CommonAttentionMetadata, qsl: np.ndarray, mask: np.ndarray, decode: bool) -> KDARows:
    """The rows in `mask`, with their tokens' positions in the step (host-built: this step has a prefill). The
    group's device tensors come in one queued upload: a plain .to(device) of a host tensor waits for the GPU to
    finish the step before (measured: 8 stream syncs per mixed step), which undid async scheduling's overlap."""
    rows = np.flatnonzero(mask)
    starts, ends = qsl[rows], qsl[rows + 1]
    lens = ends - starts
    token_idx = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)]) if len(rows) else np.zeros(0)
    group_qsl = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lens, out=group_qsl[1:])
    rows_t = torch.from_numpy(rows)
    all_slots, all_slots_cpu, accepted = _slots(common, decode)
    slots_cpu = all_slots_cpu[rows_t]
    has_init_cpu = common.num_computed_tokens_cpu[rows_t] > 0
    qsl_d, slots_d, has_init_d, rows_d, token_idx_d = async_tensors_h2d(
        [group_qsl, slots_cpu.numpy(), has_init_cpu.numpy(), rows, token_idx], common.state_indices.device)
    return KDARows(
        query_start_loc=qsl_d.int(), query_start_loc_cpu=torch.from_numpy(group_qsl),
        state_indices=slots_d.to(slots_cpu.dtype), state_indices_cpu=slots_cpu,
        has_initial_state=has_init_d.bool(), has_initial_state_cpu=has_init_cpu,
        num_reqs=len(rows), num_tokens=int(group_qsl[-1]), max_query_len=int(lens.max(initial=0)),
        token_idx=token_idx_d, num_accepted_tokens=None if accepted is None else accepted[rows_d])


class KDAAttention:
    """The KDA layers' backend pair: a prefill backend and a decode backend behind one forward."""

    def __init__(self, prefill: type[KDABackend], decode: type[KDABackend]) -> None:
        assert prefill.runs_prefill and decode.runs_decode, (prefill.name, decode.name)
        self.prefill, self.decode = prefill, decode
        self.name = prefill.name if prefill is decode else f"{prefill.name}+{decode.name}"
        self.conv_state_history_major = decode.conv_state_history_major

    def builder(self, block_size: int, record_len: int = 0) -> KDAMetadataBuilder:
        return KDAMetadataBuilder(self.decode, record_len)

    def forward(self, layer: KDAWeights, mixed_qkv: torch.Tensor, raw_gate: torch.Tensor, raw_beta: torch.Tensor,
                output_gate: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                meta: KDAMetadata, records: KDARecords | None = None) -> torch.Tensor:
        """[T, P]: each group's output at its tokens' positions (zeros at tokens that no group covers).
        `records`: the layer's RecoverSSM records, which decode rows built with `record` write."""
        groups = [(g, fn) for g, fn in ((meta.decode, self.decode.forward_decode),
                                        (meta.prefill, self.prefill.forward_prefill)) if g is not None]
        out = None
        for rows, fn in groups:
            inputs = (mixed_qkv, raw_gate, raw_beta, output_gate)
            if rows.token_idx is not None:
                inputs = tuple(x[rows.token_idx] for x in inputs)
            if rows.record:
                assert records is not None, "RecoverSSM rows on a layer without records"
                y = fn(layer, *inputs, conv_state, ssm_state, rows, records=records)
            else:
                y = fn(layer, *inputs, conv_state, ssm_state, rows)
            if rows.token_idx is None and y.shape[0] == mixed_qkv.shape[0]:
                return y
            if out is None:
                out = y.new_zeros(mixed_qkv.shape[0], y.shape[-1])
            if rows.token_idx is None:
                out[:y.shape[0]] = y
            else:
                out[rows.token_idx] = y
        assert out is not None, "a KDA step with no rows"
        return out
