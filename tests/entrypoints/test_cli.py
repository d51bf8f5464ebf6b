"""The `vllm` console script: version, help, and `generate` on the built-in model."""
from __future__ import annotations

import subprocess
import sys

import pytest

import vllm
from vllm.entrypoints.cli.main import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", *args], capture_output=True,
                          text=True, timeout=300)


def test_version_and_help():
    out = run_cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"vllm {vllm.__version__}"
    out = run_cli("--help")
    assert out.returncode == 0 and "generate" in out.stdout


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_generate_on_builtin_model(device):
    out = run_cli("generate", "--prompt", "The capital of France is", "--prompt", "Hi", "--max-tokens", "5",
                  "--device", device)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("Prompt: ") == 2 and out.stdout.count("Generated: ") == 2
    assert f"on {device}" in out.stdout


def test_generate_rejects_bad_max_tokens(capsys):
    assert main(["generate", "--max-tokens", "0"]) == 2
    assert "--max-tokens must be >= 1" in capsys.readouterr().err
