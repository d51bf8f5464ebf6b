"""Write tiny random Kimi-K3 or Kimi-Linear checkpoints (config.json + safetensors) for tests and demos.

    python -m vllm.tools.make_tiny_model --family k3 --out /tmp/tiny-k3 [--shards 2] [--seed 0]

Tensor names and layouts are the published ones (A_log [1, 1, H, 1] and conv weights [P, 1, W] for
Kimi-Linear, as transformers writes them), so the files exercise the loader exactly as real checkpoints do.
Values are random but not at their init defaults: norms, A_log, dt_bias and the router bias are perturbed.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from vllm.attention.selector import reference_backends
from vllm.model_executor.model_loader import INDEX_FILE, SINGLE_FILE
from vllm.model_executor.models.kimi_k3.model import KimiK3ForCausalLM
from vllm.transformers_utils.configs.kimi_k3 import KimiK3TextConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tiny_text_config(family: str, **overrides) -> dict:
    """A flat text config.json dict; `family` 'k3' switches on every K3-only feature."""
    cfg = dict(
        model_type="kimi_linear", vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=8, num_experts_per_token=2,
        num_shared_experts=1, num_expert_group=1, topk_group=1, routed_scaling_factor=1.0, hidden_act="silu",
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0, first_k_dense_replace=1,
        moe_renormalize=True, tie_word_embeddings=False, max_position_embeddings=4096,
        linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [4], "head_dim": 16, "num_heads": 4,
                            "short_conv_kernel_size": 4})
    if family == "k3":
        cfg.update(q_lora_rank=32, hidden_act="situ", mla_use_output_gate=True, mla_use_nope=True,
                   routed_expert_hidden_size=32, latent_moe_use_norm=True, attn_res_block_size=2,
                   num_hidden_layers=6, activation_situ_beta=4.0, activation_situ_linear_beta=25.0)
        cfg["linear_attn_config"] = {"kda_layers": [1, 2, 3, 5], "full_attn_layers": [4, 6], "head_dim": 16,
                                     "num_heads": 4, "short_conv_kernel_size": 4, "use_full_rank_gate": True,
                                     "gate_lower_bound": -5.0}
    elif family != "kimi_linear":
        raise ValueError(f"family={family!r}; expected 'k3' or 'kimi_linear'")
    cfg.update(overrides)
    return cfg


def wrap_k3(text_config: dict) -> dict:
    """The top-level kimi_k3 config.json around a text config."""
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
            "text_config": text_config, "vision_config": {"hidden_size": 32}, "media_placeholder_token_id": 3}


def random_tensor(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
    if name.endswith("dt_bias"):
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    if name.endswith("e_score_correction_bias"):
        return 0.1 * torch.randn(shape, generator=gen)
    if len(shape) == 1:  # norm weights
        return 1.0 + 0.2 * torch.randn(shape, generator=gen)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) * shape[-1] ** -0.5


def checkpoint_layout(name: str, t: torch.Tensor, cfg: KimiK3TextConfig) -> torch.Tensor:
    if name.endswith("_conv1d.weight"):
        return t.unsqueeze(1)
    if name.endswith("A_log") and cfg.model_type == "kimi_linear":
        return t.view(1, 1, -1, 1)
    return t


def random_state_dict(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    text = KimiK3TextConfig.from_dict(config)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in KimiK3ForCausalLM(text, reference_backends()).named_parameters()}
    gen = torch.Generator().manual_seed(seed)
    return {n: checkpoint_layout(n, random_tensor(n, s, gen), text).contiguous() for n, s in shapes.items()}


def write_checkpoint(out_dir: str | Path, config: dict, tensors: dict[str, torch.Tensor], shards: int = 1,
                     dtype: torch.dtype = torch.float32) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {n: t.to(dtype) for n, t in tensors.items()}
    if shards == 1:
        save_file(tensors, str(out / SINGLE_FILE))
        return
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: tensors[n] for n in part}, str(out / fname))
        weight_map.update({n: fname for n in part})
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2) + "\n")


def write_tiny_model(out_dir: str | Path, family: str = "k3", seed: int = 0, shards: int = 1,
                     dtype: torch.dtype = torch.float32, **overrides) -> str:
    """Writes a tiny random checkpoint; K3 text configs are wrapped in the kimi_k3 top-level config."""
    text = tiny_text_config(family, **overrides)
    config = wrap_k3(text) if family == "k3" else text
    write_checkpoint(out_dir, config, random_state_dict(config, seed), shards, dtype)
    return str(out_dir)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=["k3", "kimi_linear"], default="k3")
    ap.add_argument("--out", required=True, help="directory to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--vocab-size", type=int, default=256)
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--tokenizer", help="directory whose tokenizer files are copied next to the weights")
    args = ap.parse_args(argv)
    write_tiny_model(args.out, args.family, args.seed, args.shards, getattr(torch, args.dtype),
                     vocab_size=args.vocab_size, hidden_size=args.hidden_size)
    if args.tokenizer:
        for f in TOKENIZER_FILES:
            src, dst = Path(args.tokenizer) / f, Path(args.out) / f
            if src.is_file() and src.resolve() != dst.resolve():
                shutil.copy(src, dst)
    print(f"wrote a tiny {args.family} checkpoint to {args.out}")


if __name__ == "__main__":
    main()
