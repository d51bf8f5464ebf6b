"""`vllm collect-env`: what a bug report needs about this machine (upstream's subcommand, our fields)."""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys

PACKAGES = ("torch", "triton", "transformers", "tokenizers", "safetensors", "fastapi", "uvicorn", "pydantic",
            "numpy", "fla-core", "flashinfer-python", "flash-kda", "openai", "lm_eval")


def add_parser(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("collect-env", help="print the environment for a bug report",
                   description="Versions of Python, this package and its libraries, the devices, and VLLM_* "
                               "variables.")


def environment() -> dict[str, str]:
    import torch

    from vllm.version import __version__
    info = {"vllm": __version__, "python": sys.version.split()[0], "platform": platform.platform(),
            "cpu_count": str(os.cpu_count())}
    for name in PACKAGES:
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = "not installed"
    info["cuda_available"] = str(torch.cuda.is_available())
    if torch.cuda.is_available():
        info["cuda_runtime"] = str(torch.version.cuda)
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info[f"gpu{i}"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}"
    info.update({k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_") and "KEY" not in k})
    return info


def run(args: argparse.Namespace) -> int:
    for key, value in environment().items():
        print(f"{key}: {value}")
    return 0
