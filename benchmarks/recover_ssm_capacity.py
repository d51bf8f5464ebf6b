"""KDA state memory per speculating request, checkpoint columns against RecoverSSM, and the requests a fixed state
budget holds, for the built-in model, the 1.3B benchmark config and the Kimi-Linear-48B-A3B shape (20 KDA layers
of 32 heads x 128; issue 50 adds its whole config). Arithmetic from the shapes, the same functions the engine's
capacity line uses (attention/kda/recover.py record_bytes); no device needed.

    python benchmarks/recover_ssm_capacity.py --out benchmarks/results/recover_ssm_capacity.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vllm.assets import DEFAULT_MODEL_DIR
from vllm.attention.kda.recover import record_bytes
from vllm.model_executor.model_loader import load_config

CONFIGS = Path(__file__).parent / "configs"
# (KDA layers, heads, head dim, conv width)
SHAPES = {"kimi-linear-48b-a3b": (20, 32, 128, 4)}


def shape_of(config) -> tuple[int, int, int, int]:
    H, _, K = config.kda_ssm_state_shape()
    channels, history = config.kda_conv_state_shape()
    return len(config.kda_layers), H, K, history + 1


def linear_attn_shape(hf_config: dict) -> tuple[int, int, int, int]:
    lac = hf_config["linear_attn_config"]
    return len(lac["kda_layers"]), lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]


def per_request(shape, K: int, act: torch.dtype, state: torch.dtype) -> tuple[int, int]:
    """(checkpoint columns, RecoverSSM) bytes of one speculating request over all KDA layers."""
    layers, H, D, W = shape
    a, s = (torch.empty((), dtype=d).element_size() for d in (act, state))
    slot = layers * (3 * H * D * (W - 1) * a + H * D * D * s)
    return (1 + K) * slot, slot + layers * record_bytes(H, D, 3 * H * D, 1 + K, act)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-gib", type=float, default=16.0, help="state budget for the requests-held column")
    ap.add_argument("--out")
    args = ap.parse_args()
    shapes = {"built-in": shape_of(load_config(DEFAULT_MODEL_DIR)),
              "kimi-linear-1b3": linear_attn_shape(json.loads((CONFIGS / "kimi-linear-1b3.json").read_text())),
              **SHAPES}
    budget = int(args.budget_gib * 2**30)
    rows = []
    for name, shape in shapes.items():
        for state in (torch.float32, torch.bfloat16):
            for K in range(1, 8):
                columns, recover = per_request(shape, K, torch.bfloat16, state)
                rows.append({"model": name, "kda_shape": shape, "state_dtype": str(state)[6:], "K": K,
                             "columns_mib": columns / 2**20, "recover_mib": recover / 2**20,
                             "ratio": recover / columns, "requests_in_budget_columns": budget // columns,
                             "requests_in_budget_recover": budget // recover})
                print(f"{name:22s} {str(state)[6:]:8s} K={K}  columns {columns / 2**20:8.2f} MiB  RecoverSSM "
                      f"{recover / 2**20:7.2f} MiB  ({recover / columns:.3f}x)  requests in {args.budget_gib:g} GiB: "
                      f"{budget // columns} -> {budget // recover}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"budget_gib": args.budget_gib, "activation_dtype": "bfloat16", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
