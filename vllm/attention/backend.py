"""The per-step attention metadata and the interface every attention backend implements.

The runner builds one `CommonAttentionMetadata` per step; each backend's builder turns it into its own
metadata once per step (never per layer), and the backend's impl runs the layers with it.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


class AttentionCGSupport(enum.IntEnum):
    """Which batches a backend can replay inside a full CUDA graph (ordered: more is better)."""
    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    # Any decode/verify batch (rows of 1..bound tokens, ragged, lengths read from the device), never a batch with
    # a prompt chunk: what adaptive verification's re-cut rows need (upstream is adding the same level).
    VARLEN_DECODE = 3
    ALWAYS = 4


class QueryLenSupport(enum.Enum):
    """Which query lengths a backend's decode path takes per request."""
    SINGLE_ONLY = "single_only"
    UNIFORM = "uniform"
    VARLEN = "varlen"


@dataclass(slots=True)
class CommonAttentionMetadata:
    """One engine step's batch layout, shared by every attention layer.

    Tokens of all requests are flattened; request r owns tokens query_start_loc[r]:query_start_loc[r+1].
    `seq_lens` counts each request's tokens after this step (cached context + the new ones).
    `max_query_len` is a promised bound from the runner; builders never re-measure it from CPU lengths,
    and they derive per-request query lengths from the device `query_start_loc` (cum_seq_lens_q).
    """
    query_start_loc: torch.Tensor  # device int32 [B+1]
    query_start_loc_cpu: torch.Tensor  # cpu int32 [B+1]
    seq_lens: torch.Tensor  # device int32 [B]
    seq_lens_cpu: torch.Tensor  # cpu int32 [B], an upper bound of the device values
    num_reqs: int
    num_actual_tokens: int  # padding excluded
    max_query_len: int
    max_seq_len: int
    block_table: torch.Tensor  # device int32 [B, max_blocks]: MLA latent-cache blocks per request
    slot_mapping: torch.Tensor  # device int64 [num_tokens]: latent-cache row per token, -1 for padding
    is_prefilling: torch.Tensor  # cpu bool [B]: request state (a prompt chunk), not the row's shape
    # KDA recurrent-state slots: device int32 [B], or [B, 1 + K] checkpoint columns with speculative decoding.
    state_indices: torch.Tensor
    state_indices_cpu: torch.Tensor  # cpu int32, the same shape: for host-side loops (no device sync)
    # Speculative decoding: the row's tag (cpu int32 [B]): its draft count if it verifies, -1 for a prefill row;
    # and device int32 [B] tokens each request kept last step (KDA reads checkpoint column this - 1).
    num_draft_tokens: torch.Tensor | None = None
    num_accepted_tokens: torch.Tensor | None = None

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    @property
    def num_computed_tokens_cpu(self) -> torch.Tensor:
        """Tokens each request had cached before this step."""
        return self.seq_lens_cpu - self.query_lens_cpu

    def single_token_decode_rows(self) -> torch.Tensor:
        """Rows of requests decoding (not prefilling) exactly one token this step, as a CPU long tensor."""
        n = self.num_reqs
        return ((~self.is_prefilling[:n]) & (self.query_lens_cpu[:n] == 1)).nonzero().flatten()


class AttentionMetadataBuilder(ABC):
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.SINGLE_ONLY
    # Prompt chunks longer than this run another kernel path than shorter rows (the start-up warm-up crosses
    # it); None: one path for every length.
    prefill_min_query_len: int | None = None

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return False

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> Any:
        """Backend metadata for one step."""

    def build_for_capture(self, common: CommonAttentionMetadata) -> Any:
        """Metadata built inside a CUDA graph's capture (so its device work reruns on every replay): the host
        choices it makes are fixed for every step the graph replays, which are decode or verify rows only. By
        default what build makes; a builder whose host work reads a step's contents overrides it."""
        return self.build(common)


@dataclass(frozen=True, slots=True)
class LayerShapes:
    """The model shapes a kernel may be limited to (FlashKDA: K=V=128, bounded gate; FlashInfer: head counts)."""
    kda_num_heads: int = 0
    kda_head_dim: int = 0
    kda_gate_bounded: bool = False
    ssm_state_dtype: torch.dtype = torch.float32
    mla_num_heads: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    block_size: int = 0
    num_speculative_tokens: int = 0  # > 0: KDA decode must write checkpoint columns
    recover_ssm: bool = False  # RecoverSSM: KDA decode writes per-token records instead (kda/recover.py)


class AttentionBackend(ABC):
    """A named kernel family for one kind of attention (MLA, KDA prefill, KDA decode)."""
    name: ClassVar[str]

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, shapes: LayerShapes | None = None) -> str | None:
        """None when this backend runs here, else the reason it cannot (naming what it needs and what is here).

        `shapes` None asks about the device and dtype only.
        """
        return None

    @classmethod
    @abstractmethod
    def builder(cls, block_size: int) -> AttentionMetadataBuilder:
        """A metadata builder for caches of `block_size` tokens per block."""


@dataclass(slots=True)
class HybridBackends:
    """The backends of a hybrid model: a prefill/decode pair for its KDA layers, one for its MLA layers."""
    kda: Any  # KDAAttention (attention/kda/metadata.py)
    mla: type[AttentionBackend]


@dataclass(slots=True)
class HybridAttentionMetadata:
    """One step's backend metadata, built once per step for each kind of attention layer."""
    kda: Any
    mla: Any
