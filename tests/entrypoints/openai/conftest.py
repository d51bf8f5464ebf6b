"""A real `vllm serve` in a subprocess on 127.0.0.1 (one per test module), and the offline LLM to compare with."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

STARTUP_TIMEOUT_S = 180  # model load on a busy 2-core CI machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    def __init__(self, log_dir: Path, *args: str, env: dict | None = None) -> None:
        self.args, self.env, self.log_dir = args, {**os.environ, **(env or {})}, log_dir
        for _ in range(3):  # the port can be taken between picking and binding: pick another
            self.port = _free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self._start()
            if self._wait_ready():
                return
        raise RuntimeError(f"vllm serve did not start:\n{self.stderr()[-3000:]}")

    def _start(self) -> None:
        # Files, not pipes: a pipe nobody drains would block the server once full. Closed in stop().
        self.out = open(self.log_dir / f"serve-{self.port}.out", "w+")  # noqa: SIM115
        self.err = open(self.log_dir / f"serve-{self.port}.err", "w+")  # noqa: SIM115
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--host", "127.0.0.1", "--port",
               str(self.port), "--max-model-len", "512", "--disable-log-requests", "--uvicorn-log-level", "warning",
               *self.args]
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=self.err, stdin=subprocess.DEVNULL, env=self.env)

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if "address already in use" in self.stderr().lower():
                    return False
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.stderr()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"vllm serve was not healthy after {STARTUP_TIMEOUT_S} s:\n{self.stderr()[-3000:]}")

    def stdout(self) -> str:
        return Path(self.out.name).read_text()

    def stderr(self) -> str:
        return Path(self.err.name).read_text()

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30) -> float:
        """Signals the server (SIGINT: stop now; SIGTERM drains requests in flight) and returns how long it took to
        exit (kills it if it overstays `timeout`)."""
        start = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.out.close()
        self.err.close()
        return time.monotonic() - start


@pytest.fixture(scope="module")
def start_server(tmp_path_factory):
    """Call with extra `vllm serve` flags; every server started is stopped when the module ends."""
    servers = []

    def start(*args: str, env: dict | None = None) -> RemoteServer:
        servers.append(RemoteServer(tmp_path_factory.mktemp("serve"), *args, env=env))
        return servers[-1]
    yield start
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def offline_llm():
    from vllm import LLM
    return LLM(max_model_len=512)


def metrics(url: str, headers: dict | None = None) -> dict[str, float]:
    """Prometheus text parsed into {sample name: value} (labels dropped; histograms keep _count/_sum)."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "le" not in s.labels:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


@pytest.fixture(scope="session")
def read_metrics():
    return metrics
