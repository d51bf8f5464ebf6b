"""The DSpark draft checkpoint's config.json (upstream field names) and its fit to a target model."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vllm.transformers_utils.configs.kimi_k3 import KimiK3TextConfig

# Keys a DSpark config.json must carry; everything else has the default below.
REQUIRED_KEYS = ("target_layer_ids", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@dataclass(slots=True, frozen=True)
class DSparkConfig:
    """A DSpark draft: context from the target's hidden states at `target_layer_ids`, a block of anchor + K-1
    mask tokens through `num_hidden_layers` non-causal MLA + MLP layers, the target's embedding and lm_head, a
    low-rank Markov head (`markov_rank`) and, with `enable_confidence_head`, an acceptance-probability head."""
    target_layer_ids: tuple[int, ...]
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    target_hidden_size: int | None = None  # None: the draft's own hidden_size
    q_lora_rank: int = 64
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    intermediate_size: int = 512
    markov_rank: int = 64
    enable_confidence_head: bool = True
    mask_token_id: int | None = None  # None: a learned mask embedding (`mask_embedding`), not a vocabulary id
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @classmethod
    def from_json_dict(cls, raw: dict, where: str) -> DSparkConfig:
        missing = [k for k in REQUIRED_KEYS if k not in raw]
        if missing:
            raise ValueError(f"{where}: the DSpark config lacks {missing}; expected the keys {list(REQUIRED_KEYS)} "
                             "(and optionally " + ", ".join(f for f in cls.__slots__ if f not in REQUIRED_KEYS) + ")")
        known = {k: raw[k] for k in cls.__slots__ if k in raw}
        known["target_layer_ids"] = tuple(int(i) for i in known["target_layer_ids"])
        return cls(**known)

    @property
    def mla_cache_dim(self) -> int:
        """One context token in one draft layer's cache: [c_kv | k_rope]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def check_fits(self, target: KimiK3TextConfig, where: str) -> None:
        """Raises with what differs when this draft cannot serve `target`."""
        problems = []
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} != the target's {target.vocab_size}")
        if self.hidden_size != target.hidden_size:
            problems.append(f"hidden_size {self.hidden_size} != the target's {target.hidden_size} (the draft reads "
                            "the target's embedding and lm_head)")
        if self.target_hidden_size is not None and self.target_hidden_size != target.hidden_size:
            problems.append(f"target_hidden_size {self.target_hidden_size} != the target's hidden_size "
                            f"{target.hidden_size}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if not self.target_layer_ids or bad:
            problems.append(f"target_layer_ids {list(self.target_layer_ids)} must be a non-empty list of layer "
                            f"indices in [0, {target.num_hidden_layers})")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            problems.append(f"target_layer_ids {list(self.target_layer_ids)} repeat a layer")
        if self.qk_rope_head_dim % 2:
            problems.append(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        if problems:
            raise ValueError(f"{where}: this DSpark draft does not fit the target model: " + "; ".join(problems))


def read_dspark_config(model_dir: str | Path) -> DSparkConfig:
    path = Path(model_dir) / "config.json"
    where = f"--speculative-config model={str(model_dir)!r}"
    if not path.is_file():
        raise ValueError(f"{where}: no config.json there (expected a DSpark draft checkpoint directory)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: config.json is not valid JSON ({e})") from None
    return DSparkConfig.from_json_dict(raw, where)
