"""transformers' KimiLinearForCausalLM as an outside oracle: torch-only, perturbed, saved for our loader."""
from __future__ import annotations

import importlib
import json
import sys

import torch


def import_torch_only_oracle():
    """transformers picks fla-core's Triton kernels when fla is importable (decided at import time); those
    run only on CUDA and in TF32. Import the modeling file with fla hidden so the oracle is plain torch."""
    name = "transformers.models.kimi_linear.modeling_kimi_linear"
    if name not in sys.modules:
        saved = sys.modules.get("fla")
        sys.modules["fla"] = None  # makes `import fla` raise ImportError
        try:
            importlib.import_module(name)
        finally:
            if saved is None:
                del sys.modules["fla"]
            else:
                sys.modules["fla"] = saved
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    return KimiLinearConfig, KimiLinearForCausalLM


KimiLinearConfig, KimiLinearForCausalLM = import_torch_only_oracle()

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, num_local_experts=8, num_experts_per_tok=2, routed_scaling_factor=1.0,
            hidden_act="silu", rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def perturbed_hf_model(config: dict, seed: int) -> KimiLinearForCausalLM:
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(KimiLinearConfig(**config)).eval()
    with torch.no_grad():  # move everything the init leaves at a round value away from it
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "A_log", "dt_bias")):
                p.add_(0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(0.1 * torch.randn_like(b))
    return model


def save_for_us(model: KimiLinearForCausalLM, path) -> str:
    model.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    # transformers hard-codes eps 1e-6 in q_a/kv_a_layernorm; tell our config so.
    config["mla_latent_norm_eps"] = 1e-6
    (path / "config.json").write_text(json.dumps(config))
    return str(path)
