"""transformers config classes for model types that transformers does not ship, registered with AutoConfig (as
upstream's engine registers its own), so that `AutoConfig.from_pretrained` on one of our checkpoints works for
the tools that call it before handing the model to us (lm-eval's vllm backend, scripts)."""
from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig


class KimiK3Config(PretrainedConfig):
    """config.json's fields as saved: this engine reads them itself (KimiK3TextConfig); this class only lets
    transformers load and carry them."""
    model_type = "kimi_k3"


def register_configs() -> None:
    AutoConfig.register(KimiK3Config.model_type, KimiK3Config, exist_ok=True)
