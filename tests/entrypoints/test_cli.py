"""The `vllm` console script: version, help, and `generate` on the built-in model."""
from __future__ import annotations

import json
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


# ---- run-batch: hostile input ---------------------------------------------------------------------------------

def test_run_batch_missing_input_and_unwritable_output_fail_in_one_line(capsys, tmp_path):
    missing = tmp_path / "nope.jsonl"
    assert main(["run-batch", "-i", str(missing), "-o", str(tmp_path / "out.jsonl")]) == 2
    err = capsys.readouterr().err
    assert f"cannot read the input file {missing}" in err and "Traceback" not in err
    src = tmp_path / "in.jsonl"
    src.write_text('{"url": "/v1/completions", "body": {"prompt": "x"}}\n')
    for dst in (tmp_path, tmp_path / "no" / "such" / "dir.jsonl"):  # checked before the engine loads
        assert main(["run-batch", "-i", str(src), "-o", str(dst)]) == 2
        err = capsys.readouterr().err
        assert f"cannot write the output file {dst}" in err and "Traceback" not in err


def test_run_batch_writes_results_in_order_as_they_are_ready(tmp_path):
    from vllm.entrypoints.cli.run_batch import OrderedWriter
    path = tmp_path / "out.jsonl"
    with path.open("w") as f:
        writer = OrderedWriter(f)
        writer.put(1, {"custom_id": "b", "error": None})
        assert path.read_text() == ""  # line 0 is not done yet
        writer.put(0, {"custom_id": "a", "error": {"message": "bad"}})
        assert [json.loads(x)["custom_id"] for x in path.read_text().splitlines()] == ["a", "b"]  # flushed
        assert (writer.written, writer.failed) == (2, 1)


def test_run_batch_answers_every_line_whatever_the_others_do(capsys, tmp_path):
    good = {"custom_id": "ok", "url": "/v1/completions", "body": {"prompt": "Hi", "max_tokens": 2}}
    lines = [json.dumps(good).encode(),
             b"[" * 50_000 + b"]" * 50_000,  # RecursionError in json.loads
             b'{"custom_id": "\xff", "url": "/v1/completions"}',  # not UTF-8
             json.dumps({**good, "custom_id": "abc\ud800"}).encode(),  # a lone surrogate echoed back
             json.dumps({**good, "custom_id": "last"}).encode()]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    assert main(["run-batch", "-i", str(src), "-o", str(dst), "--max-model-len", "128",
                 "--kv-cache-memory-bytes", str(1 << 24)]) == 0
    assert "5 requests, 2 failed" in capsys.readouterr().out
    results = [json.loads(x) for x in dst.read_text(encoding="utf-8").splitlines()]
    assert [r["custom_id"] for r in results] == ["ok", None, None, "abc\ud800", "last"]  # escaped, not lost
    assert [r["error"] is None for r in results] == [True, False, False, True, True]
    assert "nests arrays or objects too deeply" in results[1]["error"]["message"]
    assert "utf-8" in results[2]["error"]["message"]


@pytest.mark.parametrize("flag", ["--speculative-config", "--compilation-config", "--hf-overrides"])
def test_json_flags_nested_too_deeply_are_argparse_errors(capsys, flag):
    with pytest.raises(SystemExit) as e:
        main(["generate", flag, "[" * 30_000])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert f"error: argument {flag}" in err and "not valid JSON: arrays or objects nested too deeply" in err


def test_serve_cors_flags_nested_too_deeply_are_argparse_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--allowed-origins", "[" * 30_000])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert "error: argument --allowed-origins: not valid JSON" in err


def test_a_config_file_nested_too_deeply_is_one_line(tmp_path, capsys):
    config = tmp_path / "deep.yaml"
    config.write_text("max-model-len: " + "[" * 100_000 + "]" * 100_000 + "\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert capsys.readouterr().err.strip() == f"error: --config {config}: lists or mappings nested too deeply to read"


def test_serve_honours_a_ctrl_c_that_loading_swallowed(monkeypatch):
    """A SIGINT lost inside third-party code while the engine loads (a bare `except:`) still stops `vllm serve`
    once loading ends: the engine is shut down and the interrupt raised, never the server started."""
    import os
    import signal

    from vllm.engine.async_llm import AsyncLLM
    from vllm.entrypoints.cli import serve
    from vllm.entrypoints.cli.main import build_parser
    from vllm.entrypoints.openai import api_server

    shut = []

    class Engine:
        async def shutdown(self):
            shut.append(True)

    def loading_that_swallows(cls, args):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
        except KeyboardInterrupt:
            pass
        return Engine()

    monkeypatch.setattr(AsyncLLM, "from_engine_args", classmethod(loading_that_swallows))
    monkeypatch.setattr(api_server, "run_server", lambda *a, **k: pytest.fail("the server started"))
    previous = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        serve.run(build_parser().parse_args(["serve", "--port", "0"]))
    assert shut == [True]
    assert signal.getsignal(signal.SIGINT) is previous, "loading's handler is gone"
