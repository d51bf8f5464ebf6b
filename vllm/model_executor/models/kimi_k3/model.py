"""KimiK3ForCausalLM: one torch model for Kimi-Linear and Kimi-K3, over the engine's flat token batch.

forward(input_ids [T], positions [T], attn_metadata) runs every request of a step at once; the KDA and MLA
layers read their backend metadata from `attn_metadata` (built once per step) and their caches from the
pools bound with `bind_caches`. Logits are computed only for the rows the caller selects.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from vllm.attention.backend import HybridAttentionMetadata, HybridBackends
from vllm.attention.kda.recover import KDARecords, allocate_records
from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding, vocab_parallel_logits
from vllm.model_executor.models.kimi_k3.attn_res import attn_res_mix, attn_res_stack
from vllm.model_executor.models.kimi_k3.kda import KimiDeltaAttention
from vllm.model_executor.models.kimi_k3.mla import KimiMLAAttention
from vllm.model_executor.models.kimi_k3.moe import KimiMLP, KimiMoE
from vllm.transformers_utils.configs.kimi_k3 import KimiK3TextConfig

_EXPERT_PARAM = re.compile(r"^(model\.layers\.(\d+)\.block_sparse_moe\.experts\.)(\d+)(\..*)$")
# Parameters kept in float32 whatever the model dtype: the gate and router math is done in float32.
FP32_PARAM_SUFFIXES = ("A_log", "dt_bias", "_conv1d.weight", "gate.weight", "gate.e_score_correction_bias")


@dataclass(slots=True)
class KimiLayerCache:
    """One layer's cache views: `kv_cache` for MLA; `conv_state`, `ssm_state` (and RecoverSSM's `records`) for KDA."""
    kv_cache: torch.Tensor | None = None
    conv_state: torch.Tensor | None = None
    ssm_state: torch.Tensor | None = None
    records: KDARecords | None = None


@dataclass(slots=True)
class KDAStatePools:
    """Every KDA layer's state pools stacked over the layers ([L, slots, ...]; the layers hold views), so that one
    launch or copy covers them all: RecoverSSM's commit, prefix caching's snapshot copies."""
    conv_state: torch.Tensor  # [L, slots, 3P, W-1]
    ssm_state: torch.Tensor  # [L, slots, H, V, K]
    records: KDARecords | None = None


@dataclass(slots=True)
class LayerCaches:
    layers: list[KimiLayerCache]
    kda: KDAStatePools | None


def allocate_layer_caches(config: KimiK3TextConfig, num_blocks: int, block_size: int, num_slots: int,
                          dtype: torch.dtype, state_dtype: torch.dtype, device: torch.device | str,
                          conv_history_major: bool = False, record_len: int = 0,
                          record_slots: int | None = None) -> LayerCaches:
    """Zeroed cache pools for every layer: MLA latent blocks and KDA conv/recurrent state slots (and, with
    `record_len`, RecoverSSM's records of that many tokens for the first `record_slots` slots: the requests'
    ones; None: all).

    Conv states are [slots, 3P, W-1] views either way; `conv_history_major` stores each slot's W-1 columns of
    3P channels contiguously (strides [slot, 1, 3P]), the layout FlashInfer's fused KDA decode reads.
    """
    kda = None
    num_kda = len(config.kda_layers)
    tp = get_tensor_model_parallel_world_size()  # each rank holds its own heads' states
    if num_kda:
        channels, history = config.kda_conv_state_shape(tp_size=tp)
        conv = (torch.zeros(num_kda, num_slots, history, channels, dtype=dtype, device=device).transpose(2, 3)
                if conv_history_major else
                torch.zeros(num_kda, num_slots, channels, history, dtype=dtype, device=device))
        H, _, K = config.kda_ssm_state_shape(tp)
        records = allocate_records(num_kda, num_slots if record_slots is None else record_slots, H, K, channels,
                                   record_len, dtype, device) if record_len else None
        kda = KDAStatePools(conv, torch.zeros(num_kda, num_slots, *config.kda_ssm_state_shape(tp),
                                              dtype=state_dtype, device=device), records)
    caches, i = [], 0
    for layer in range(config.num_hidden_layers):
        if config.is_kda_layer(layer):
            caches.append(KimiLayerCache(conv_state=kda.conv_state[i], ssm_state=kda.ssm_state[i],
                                         records=kda.records.layer(i) if kda.records is not None else None))
            i += 1
        else:
            caches.append(KimiLayerCache(kv_cache=torch.zeros(num_blocks, block_size, config.mla_cache_dim,
                                                              dtype=dtype, device=device)))
    return LayerCaches(caches, kda)


class KimiDecoderLayer(nn.Module):
    def __init__(self, config: KimiK3TextConfig, idx: int, backends: HybridBackends) -> None:
        super().__init__()
        D = config.hidden_size
        self.is_kda = config.is_kda_layer(idx)
        self.self_attn = (KimiDeltaAttention(config, idx, backends.kda) if self.is_kda
                          else KimiMLAAttention(config, idx, backends.mla))
        # Checkpoint names: a dense layer is `mlp.*`, a MoE layer `block_sparse_moe.*`.
        if config.is_moe_layer(idx):
            self.block_sparse_moe = KimiMoE(config)
        else:
            self.mlp = KimiMLP(config, D, config.intermediate_size)
        self.input_layernorm = RMSNorm(D, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(D, eps=config.rms_norm_eps)
        if config.attn_res_block_size is not None:
            self.self_attention_res_norm = RMSNorm(D, eps=config.rms_norm_eps)
            self.self_attention_res_proj = nn.Linear(D, 1, bias=False)
            self.mlp_res_norm = RMSNorm(D, eps=config.rms_norm_eps)
            self.mlp_res_proj = nn.Linear(D, 1, bias=False)

    def mixer(self, x: torch.Tensor, attn_metadata: HybridAttentionMetadata) -> torch.Tensor:
        return self.self_attn(x, attn_metadata.kda if self.is_kda else attn_metadata.mla)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x)


class KimiK3Model(nn.Module):
    def __init__(self, config: KimiK3TextConfig, backends: HybridBackends) -> None:
        super().__init__()
        self.config = config
        D = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, D)
        self.layers = nn.ModuleList(KimiDecoderLayer(config, i, backends) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(D, eps=config.rms_norm_eps)
        if config.attn_res_block_size is not None:
            self.output_attn_res_norm = RMSNorm(D, eps=config.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(D, 1, bias=False)
        # DSpark's context: layer index -> column block of a persistent [max_tokens, n * D] buffer that each
        # forward fills with the stream after that layer (a fixed buffer, so CUDA graphs fill it too).
        self.captured_columns: dict[int, int] = {}
        self.captured_hidden: torch.Tensor | None = None

    def capture_hidden_states(self, layer_ids: tuple[int, ...], buffer: torch.Tensor) -> None:
        """From now on every forward writes the residual stream after each layer in `layer_ids` (for AttnRes
        stacks: the running block sum after the layer) into buffer[:T, j * D:(j + 1) * D], j its rank."""
        self.captured_columns = {layer: j for j, layer in enumerate(layer_ids)}
        self.captured_hidden = buffer

    def _capture(self, layer: int, h: torch.Tensor) -> None:
        j = self.captured_columns.get(layer)
        if j is not None:
            D = h.shape[-1]
            self.captured_hidden[:h.shape[0], j * D:(j + 1) * D].copy_(h)

    def forward(self, input_ids: torch.Tensor, attn_metadata: HybridAttentionMetadata) -> torch.Tensor:
        """Pre-norm hidden states [T, D] of the last layer (the final norm is applied in compute_logits)."""
        if self.config.attn_res_block_size is not None:
            return self._forward_attn_res(self.embed_tokens(input_ids), attn_metadata)
        h, x, inputs = self.begin(input_ids)
        last = len(self.layers) - 1
        for i in range(last):
            h, x, inputs = self.between(i, self.attend(i, inputs, attn_metadata), h, x)
        return self.end(self.attend(last, inputs, attn_metadata), h, x)

    # The forward in pieces that cut each layer at its attention core: begin, then for each layer its core
    # (`attend`, the only part that reads the attention metadata, caches and states) and the piece after it
    # (`between` up to the next core, `end` after the last). Piecewise CUDA graphs (vllm/worker/piecewise.py)
    # capture the pieces and run the cores eagerly; the eager forward runs the same code. Each residual add is
    # fused into the norm after it: h = h + delta, x = norm(h) in one launch. Not for AttnRes stacks.
    def begin(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """(residual stream h, first layer's normed input x, its core's inputs)."""
        h = self.embed_tokens(input_ids)
        x = self.layers[0].input_layernorm(h)
        return h, x, self.layers[0].self_attn.project(x)

    def attend(self, i: int, inputs: tuple[torch.Tensor, ...], attn_metadata: HybridAttentionMetadata):
        layer = self.layers[i]
        return layer.self_attn.attend(inputs, attn_metadata.kda if layer.is_kda else attn_metadata.mla)

    def between(self, i: int, y: torch.Tensor, h: torch.Tensor,
                x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """From layer i's core output `y` to layer i+1's core inputs: (h, x, inputs) as `begin` returns them."""
        layer, following = self.layers[i], self.layers[i + 1]
        x, h = layer.post_attention_layernorm(layer.self_attn.output(y, x), h)
        x, h = following.input_layernorm(layer.ffn(x), h)
        self._capture(i, h)
        return h, x, following.self_attn.project(x)

    def end(self, y: torch.Tensor, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        layer = self.layers[-1]
        x, h = layer.post_attention_layernorm(layer.self_attn.output(y, x), h)
        h = h + layer.ffn(x)
        self._capture(len(self.layers) - 1, h)
        return h

    def _forward_attn_res(self, emb: torch.Tensor, attn_metadata: HybridAttentionMetadata) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        sources = attn_res_stack(
            self.layers, emb, self.config.attn_res_block_size,
            attention=lambda layer, x: layer.mixer(layer.input_layernorm(x), attn_metadata),
            feed_forward=lambda layer, x: layer.ffn(layer.post_attention_layernorm(x)),
            layer_output=self._capture if self.captured_columns else None)
        return attn_res_mix(sources, self.output_attn_res_norm.weight, self.output_attn_res_proj.weight, eps)


class KimiK3ForCausalLM(nn.Module):
    def __init__(self, config: KimiK3TextConfig, backends: HybridBackends) -> None:
        super().__init__()
        self.config = config
        self.backends = backends
        self.model = KimiK3Model(config, backends)
        if not config.tie_word_embeddings:
            # ParallelLMHead: this rank's vocabulary rows (vocab_parallel_embedding.py)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size // get_tensor_model_parallel_world_size(),
                                     bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: HybridAttentionMetadata) -> torch.Tensor:
        # Kimi attention is NoPE: positions are part of the engine interface but unused by this model.
        del positions
        return self.model(input_ids, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] for the hidden rows given (only the rows that sample)."""
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return vocab_parallel_logits(self.model.norm(hidden_states), weight)

    def local_param_name(self, name: str) -> str | None:
        """A checkpoint parameter's name on this rank: under expert parallelism a routed expert is renumbered
        among this rank's experts, or None when another rank holds it; any other name is itself."""
        m = _EXPERT_PARAM.match(name)
        if m is None:
            return name
        moe = self.model.layers[int(m.group(2))].block_sparse_moe
        if moe.local_experts is None:
            return name
        e = int(m.group(3)) - moe.expert_start
        return f"{m.group(1)}{e}{m.group(4)}" if 0 <= e < moe.local_experts else None

    def bind_caches(self, caches: LayerCaches | list[KimiLayerCache]) -> None:
        """Point every layer at its cache views (owned by the engine's cache manager)."""
        layers = caches.layers if isinstance(caches, LayerCaches) else caches
        for layer, cache in zip(self.model.layers, layers, strict=True):
            attn = layer.self_attn
            if layer.is_kda:
                attn.conv_state, attn.ssm_state, attn.records = cache.conv_state, cache.ssm_state, cache.records
            else:
                attn.kv_cache = cache.kv_cache

    def process_weights_after_loading(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.process_weights_after_loading()
            ffn = layer.block_sparse_moe if hasattr(layer, "block_sparse_moe") else layer.mlp
            ffn.process_weights_after_loading()
