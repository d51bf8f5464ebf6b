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


@pytest.mark.parametrize("argv, fragment", [
    (["--max-tokens", "0"], "max_tokens must be an integer >= 1 (or None), got 0"),
    (["--max-num-seqs", "0"], "--max-num-seqs=0 is invalid"),
    (["--model", "/nonexistent"], "model directory '/nonexistent' does not exist"),
])
def test_generate_rejects_bad_input_with_one_line(capsys, argv, fragment):
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err
