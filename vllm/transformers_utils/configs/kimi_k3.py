"""The language-model configuration shared by Kimi-Linear and Kimi-K3.

One dataclass covers both families; the K3-only features are switches (see docs/model.md). It is parsed
from either the flat `kimi_linear` config.json (as transformers writes it, with its alias names) or a
`kimi_k3` config.json whose `text_config` holds the language model.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.transformers_utils.checkpoint_errors import CheckpointError, InconsistentLayersError, UnknownModelTypeError

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("kimi_linear", "kimi_k3")

# transformers renames these on save; either spelling is accepted (left: ours, right: the alternatives).
_ALIASES = {
    "num_experts": ("num_local_experts",),
    "num_experts_per_token": ("num_experts_per_tok",),
    "num_shared_experts": ("n_shared_experts",),
    "num_expert_group": ("n_group",),
    "moe_renormalize": ("norm_topk_prob",),
    "max_position_embeddings": ("model_max_length",),
}


_POSITIVE_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings", "kda_num_heads",
                  "kda_head_dim", "conv_kernel_size", "num_attention_heads", "kv_lora_rank", "v_head_dim",
                  "intermediate_size", "moe_intermediate_size", "moe_layer_freq", "num_experts",
                  "num_experts_per_token", "num_expert_group", "topk_group")
_NON_NEGATIVE_INTS = ("qk_nope_head_dim", "qk_rope_head_dim", "first_k_dense_replace", "num_shared_experts")
_OPTIONAL_POSITIVE_INTS = ("q_lora_rank", "routed_expert_hidden_size", "attn_res_block_size")
_POSITIVE_FLOATS = ("rms_norm_eps", "mla_latent_norm_eps", "activation_situ_beta", "activation_situ_linear_beta",
                    "routed_scaling_factor")
_BOOLS = ("tie_word_embeddings", "use_full_rank_gate", "mla_use_output_gate", "moe_renormalize",
          "latent_moe_use_norm")


@dataclass(slots=True)
class KimiK3TextConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    # 0-indexed layer ids; together they cover every layer exactly once.
    kda_layers: list[int]
    mla_layers: list[int]
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    max_position_embeddings: int = 1 << 20
    # KDA
    kda_num_heads: int = 32
    kda_head_dim: int = 128
    conv_kernel_size: int = 4
    use_full_rank_gate: bool = False  # K3: g_proj [P, D]; Kimi-Linear: g_a_proj/g_b_proj
    gate_lower_bound: float | None = None  # K3: g = lb*sigmoid(..); None: g = -exp(A)*softplus(..)
    # MLA
    num_attention_heads: int = 32
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_output_gate: bool = False
    # transformers' Kimi-Linear hard-codes 1e-6 for q_a/kv_a_layernorm; the published engines use
    # rms_norm_eps. None means rms_norm_eps.
    mla_latent_norm_eps: float | None = None
    # MLP / MoE
    hidden_act: str = "silu"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    intermediate_size: int = 1024
    moe_intermediate_size: int = 256
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    num_experts: int = 8
    num_experts_per_token: int = 2
    num_shared_experts: int = 0
    num_expert_group: int = 1
    topk_group: int = 1
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    routed_expert_hidden_size: int | None = None  # latent MoE width; None: experts read D directly
    latent_moe_use_norm: bool = True
    # Block AttnRes; None: plain pre-norm residuals
    attn_res_block_size: int | None = None
    model_type: str = "kimi_linear"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._check_types()
        for name, ids in (("kda_layers", self.kda_layers), ("full_attn_layers", self.mla_layers)):
            repeated = sorted({i + 1 for i in ids if ids.count(i) > 1})
            if repeated:
                raise InconsistentLayersError(f"linear_attn_config.{name} lists layers {repeated} more than once")
        layers = sorted(self.kda_layers + self.mla_layers)
        if layers != list(range(self.num_hidden_layers)):
            everything = set(range(self.num_hidden_layers))
            problems = {
                "in both kda_layers and full_attn_layers": sorted(set(self.kda_layers) & set(self.mla_layers)),
                "in neither list": sorted(everything - set(layers)),
                "out of range": sorted(set(layers) - everything),
            }
            detail = "; ".join(f"{what}: {[i + 1 for i in ids]}" for what, ids in problems.items() if ids)
            raise InconsistentLayersError(
                f"linear_attn_config must assign each of the num_hidden_layers={self.num_hidden_layers} layers "
                f"(1-indexed) to exactly one of kda_layers / full_attn_layers; {detail}")
        if self.hidden_act not in ("silu", "situ"):
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; expected 'silu' or 'situ'")
        if self.gate_lower_bound is not None and not -5.0 <= self.gate_lower_bound < 0.0:
            raise ValueError(f"gate_lower_bound={self.gate_lower_bound} must lie in [-5, 0)")
        if self.num_experts % self.num_expert_group:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by "
                             f"num_expert_group={self.num_expert_group}")
        if not 1 <= self.topk_group <= self.num_expert_group:
            raise ValueError(f"topk_group={self.topk_group} must lie in [1, num_expert_group="
                             f"{self.num_expert_group}]")
        if self.num_experts_per_token > self.num_experts:
            raise ValueError(f"num_experts_per_token={self.num_experts_per_token} exceeds "
                             f"num_experts={self.num_experts}")

    def _check_types(self) -> None:
        """Each field's type and range, so a bad value is named here instead of failing deep in the model."""
        def fail(name: str, expected: str) -> None:
            raise CheckpointError(f"{name} must be {expected}, got {getattr(self, name)!r}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)
        for name in _POSITIVE_INTS:
            if not (is_int(getattr(self, name)) and getattr(self, name) > 0):
                fail(name, "a positive integer")
        for name in _NON_NEGATIVE_INTS:
            if not (is_int(getattr(self, name)) and getattr(self, name) >= 0):
                fail(name, "an integer >= 0")
        for name in _OPTIONAL_POSITIVE_INTS:
            v = getattr(self, name)
            if v is not None and not (is_int(v) and v > 0):
                fail(name, "a positive integer or null")
        for name in _POSITIVE_FLOATS:
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")):
                fail(name, "a positive number")
        if self.gate_lower_bound is not None and (isinstance(self.gate_lower_bound, bool)
                                                  or not isinstance(self.gate_lower_bound, (int, float))):
            fail("gate_lower_bound", "a number in [-5, 0) or null")
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                fail(name, "true or false")
        for name in ("bos_token_id", "pad_token_id"):
            if getattr(self, name) is not None and not is_int(getattr(self, name)):
                fail(name, "an integer token id or null")
        eos = self.eos_token_id
        if eos is not None and not is_int(eos) and not (isinstance(eos, list) and all(map(is_int, eos))):
            fail("eos_token_id", "a token id, a list of token ids or null")
        for name in ("kda_layers", "mla_layers"):
            if not (isinstance(getattr(self, name), list) and all(map(is_int, getattr(self, name)))):
                raise CheckpointError(f"linear_attn_config's layer lists must hold integers, got "
                                      f"{getattr(self, name)!r}")
        if not isinstance(self.hidden_act, str):
            fail("hidden_act", "a string")

    # ---- derived shapes -------------------------------------------------------------------------
    @property
    def kda_proj_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_cache_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def latent_norm_eps(self) -> float:
        return self.rms_norm_eps if self.mla_latent_norm_eps is None else self.mla_latent_norm_eps

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    def is_kda_layer(self, layer: int) -> bool:
        return layer in self.kda_layers

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    def num_attn_res_blocks(self) -> int:
        assert self.attn_res_block_size is not None
        return -(-self.num_hidden_layers // self.attn_res_block_size)

    def kda_ssm_state_shape(self, tp_size: int = 1) -> tuple[int, int, int]:
        """Per-slot recurrent state [H, V, K] (the engine's layout; HF and fla keep [H, K, V]) of one of `tp_size`
        tensor-parallel ranks (each holds its heads' states)."""
        return (self.kda_num_heads // tp_size, self.kda_head_dim, self.kda_head_dim)

    def kda_conv_state_shape(self, num_spec: int = 0, tp_size: int = 1) -> tuple[int, int]:
        """Per-slot conv state: the last W-1 (+num_spec) pre-conv inputs of the 3P q/k/v channels (a rank's
        share of them under tensor parallelism)."""
        return (3 * self.kda_proj_dim // tp_size, self.conv_kernel_size - 1 + num_spec)

    # ---- parsing --------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> KimiK3TextConfig:
        if not isinstance(raw, dict):
            raise CheckpointError(f"config.json must hold a JSON object, not {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnknownModelTypeError(
                f"config.json has model_type={model_type!r}; this engine runs {list(SUPPORTED_MODEL_TYPES)}")
        if model_type == "kimi_k3":
            ignored = [k for k in ("vision_config", "media_placeholder_token_id") if k in raw]
            if ignored:
                logger.info("kimi_k3 config: ignoring %s (this engine serves the text model only)", ignored)
            if not isinstance(raw.get("text_config"), dict):
                raise CheckpointError("a kimi_k3 config.json must hold the language model as an object in "
                                      "'text_config'")
            text = dict(raw["text_config"])
            text.setdefault("model_type", "kimi_linear")
            cfg = cls.from_dict(text)
            cfg.model_type = "kimi_k3"
            return cfg
        return cls(**_text_kwargs(raw))


def _get(raw: dict[str, Any], name: str, default: Any = None) -> Any:
    for key in (name, *_ALIASES.get(name, ())):
        if key in raw:
            return raw[key]
    return default


def _layer_lists(raw: dict[str, Any], num_layers: int) -> tuple[list[int], list[int]]:
    lac = raw.get("linear_attn_config") or {}
    if "kda_layers" in lac or "full_attn_layers" in lac:
        # The published configs list layers 1-indexed.
        return [i - 1 for i in lac.get("kda_layers", [])], [i - 1 for i in lac.get("full_attn_layers", [])]
    types = raw.get("layer_types")
    if types is None:
        raise InconsistentLayersError(
            "config.json names no layer pattern: expected linear_attn_config.kda_layers/full_attn_layers "
            "(1-indexed) or layer_types")
    if len(types) != num_layers:
        raise InconsistentLayersError(f"layer_types has {len(types)} entries but num_hidden_layers={num_layers}")
    bad = sorted({t for t in types} - {"linear_attention", "full_attention"})
    if bad:
        raise InconsistentLayersError(f"layer_types holds {bad}; expected 'linear_attention' or 'full_attention'")
    return ([i for i, t in enumerate(types) if t == "linear_attention"],
            [i for i, t in enumerate(types) if t == "full_attention"])


def _text_kwargs(raw: dict[str, Any]) -> dict[str, Any]:
    for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if key not in raw:
            raise CheckpointError(f"config.json lacks the required key {key!r}")
    num_layers = raw["num_hidden_layers"]
    kda, mla = _layer_lists(raw, num_layers)
    lac = raw.get("linear_attn_config") or {}
    kw: dict[str, Any] = dict(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], num_hidden_layers=num_layers,
        kda_layers=kda, mla_layers=mla, model_type=raw["model_type"],
        kda_num_heads=lac.get("num_heads", raw.get("linear_num_heads", 32)),
        kda_head_dim=lac.get("head_dim", raw.get("linear_head_dim", 128)),
        conv_kernel_size=lac.get("short_conv_kernel_size", raw.get("linear_conv_kernel_dim", 4)),
        use_full_rank_gate=bool(lac.get("use_full_rank_gate", raw.get("use_full_rank_gate", False))),
        gate_lower_bound=lac.get("gate_lower_bound", raw.get("gate_lower_bound")),
    )
    simple = [f for f in KimiK3TextConfig.__dataclass_fields__
              if f not in kw and f not in ("extra", "kda_layers", "mla_layers")]
    for name in simple:
        value = _get(raw, name)
        if value is not None:
            kw[name] = value
    if raw.get("mlp_layer_types") is not None and "first_k_dense_replace" not in raw:
        kw["first_k_dense_replace"] = raw["mlp_layer_types"].count("dense")
    if raw.get("mla_use_nope") is False:
        raise ValueError("mla_use_nope=false (RoPE in the target's MLA) is not supported; Kimi models use NoPE")
    consumed = set(kw) | {alias for names in _ALIASES.values() for alias in names}
    kw["extra"] = {k: v for k, v in raw.items() if k not in consumed}
    return kw
