"""Tuned tiles of the fused MoE, stored as JSON per (experts E, intermediate N, hidden K, device, dtype), as
upstream's fused-MoE configs are (named without their '=' and ','): `configs/E256-N1024-K2304-NVIDIA_H100_80GB_HBM3
-bf16.json` maps a token count to the gate/up and down tiles that were fastest for it
(benchmarks/kernels/tune_fused_moe.py writes them). A step takes the entry of the nearest token count; shapes
and devices with no file fall back to the fitted heuristic (fused_moe.pick_config).
"""
from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True, slots=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    # gate/up only: one GEMM over all 2I columns, then the activation in its own launch, instead of the fused
    # kernel's two accumulators (their registers cap its tiles: large routings can run faster unfused)
    split_act: bool = False


@functools.lru_cache
def device_name(device: torch.device) -> str:
    """Cached: eager steps ask once per MoE layer."""
    return torch.cuda.get_device_name(device).replace(" ", "_") if device.type == "cuda" else "cpu"


def config_file_name(num_experts: int, inter: int, hidden: int, device: str, dtype: torch.dtype) -> str:
    return f"E{num_experts}-N{inter}-K{hidden}-{device}-{_DTYPE_NAMES[dtype]}.json"


def table_to_json(table: dict[int, tuple[GemmConfig, GemmConfig]]) -> dict:
    return {str(t): {"up": asdict(up), "down": asdict(down)} for t, (up, down) in sorted(table.items())}


@functools.lru_cache
def load_table(name: str, directory: Path = CONFIG_DIR) -> dict[int, tuple[GemmConfig, GemmConfig]] | None:
    """The file's token count -> (up, down) tiles; None where there is no such file. A malformed file is an error
    naming it (it ships with the package: a broken one is a bug, not a fallback)."""
    path = directory / name
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        table = {int(t): (GemmConfig(**e["up"]), GemmConfig(**e["down"])) for t, e in raw.items()}
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"fused MoE tile config {path} is malformed ({type(e).__name__}: {e}); expected "
                         '{"<tokens>": {"up": {block_m, block_n, block_k, num_warps, num_stages[, split_act]}, '
                         '"down": {...}}}')
    if any(up.block_m != down.block_m for up, down in table.values()):
        raise ValueError(f"fused MoE tile config {path}: up and down tiles must share block_m (one sorted layout)")
    if any(down.split_act for _, down in table.values()):
        raise ValueError(f"fused MoE tile config {path}: split_act applies to the up tiles only")
    return table or None


def tuned_config(tokens: int, num_experts: int, inter: int, hidden: int, dtype: torch.dtype,
                 device: torch.device, directory: Path = CONFIG_DIR) -> tuple[GemmConfig, GemmConfig] | None:
    """The tuned tiles for `tokens` (the nearest tuned count; ties to the smaller), or None without a table."""
    if dtype not in _DTYPE_NAMES:
        return None
    table = load_table(config_file_name(num_experts, inter, hidden, device_name(device), dtype), directory)
    if table is None:
        return None
    return table[min(table, key=lambda t: (abs(t - tokens), t))]
