"""Write a DSpark draft checkpoint with random weights for a target model (tests, and the trainer's start).

    python -m vllm.tools.make_dspark_draft OUT [--target DIR] [--layers N] [--seed S]

The config uses upstream's field names (`target_layer_ids`, `markov_rank`, `enable_confidence_head`, ...);
tensors are named as vllm/model_executor/models/dspark/model.py names its modules.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from vllm.assets import DEFAULT_MODEL_DIR
from vllm.model_executor.model_loader import load_config
from vllm.model_executor.models.dspark.model import DSparkDraftModel
from vllm.tools.make_tiny_model import write_checkpoint
from vllm.transformers_utils.configs.dspark import DSparkConfig


def dspark_config_for(target_dir: str | Path, num_layers: int = 2, **overrides) -> dict:
    """A small draft for the target: hidden size and vocabulary from it, context from three spread layers."""
    target = load_config(target_dir)
    L = target.num_hidden_layers
    cfg = {"architectures": ["DSparkDraftModel"], "model_type": "dspark",
           "target_layer_ids": sorted({1, L // 2, L - 2} & set(range(L))) or [0],
           "hidden_size": target.hidden_size, "num_hidden_layers": num_layers, "num_attention_heads": 4,
           "vocab_size": target.vocab_size, "q_lora_rank": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
           "qk_rope_head_dim": 16, "v_head_dim": 32, "intermediate_size": 2 * target.hidden_size,
           "markov_rank": 64, "enable_confidence_head": True, "rms_norm_eps": target.rms_norm_eps}
    return {**cfg, **overrides}


def random_draft_state_dict(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Unit-gain norms, weights ~ N(0, 1/fan_in); the mask embedding and Markov codes ~ N(0, 1)."""
    with torch.device("meta"):
        model = DSparkDraftModel(DSparkConfig.from_json_dict(config, "make_dspark_draft"))
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        if "norm" in name:
            out[name] = torch.ones(p.shape)
        elif p.dim() == 1:
            out[name] = torch.randn(p.shape, generator=gen) * (1.0 if name == "mask_embedding" else 0.02)
        else:
            scale = 1.0 if name == "markov_head.w1.weight" else p.shape[-1] ** -0.5
            out[name] = torch.randn(p.shape, generator=gen) * scale
    return out


def write_dspark_draft(out_dir: str | Path, target_dir: str | Path = DEFAULT_MODEL_DIR, seed: int = 0,
                       **overrides) -> str:
    config = dspark_config_for(target_dir, **overrides)
    write_checkpoint(out_dir, config, random_draft_state_dict(config, seed))
    return str(out_dir)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--target", default=str(DEFAULT_MODEL_DIR))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(write_dspark_draft(args.out, args.target, args.seed, num_layers=args.layers))


if __name__ == "__main__":
    main()
