"""SIGTERM / SIGINT with requests in flight: the process exits within seconds, cleanly, and every client gets
either its answer or an error (never a hang)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

EXIT_LIMIT_S = 10  # generous for a loaded 2-core CI box; typically about 1 s
BODY = {"prompt": "Once upon a time", "max_tokens": 480, "temperature": 0, "ignore_eos": True}


async def _stream(client: httpx.AsyncClient, first: asyncio.Event) -> str:
    async with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
        assert r.status_code == 200
        last = None
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                first.set()
                last = line
                if line != "data: [DONE]" and "error" in json.loads(line[6:]):
                    return "error"
    return "done" if last == "data: [DONE]" else "cut"


async def _whole(client: httpx.AsyncClient) -> int | str:
    try:
        return (await client.post("/v1/completions", json=BODY)).status_code
    except httpx.TransportError as e:
        return repr(e)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_with_requests_in_flight(start_server, read_metrics, sig):
    server = start_server("--shutdown-timeout", "0")  # SIGTERM aborts too (its default drains)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            firsts = [asyncio.Event() for _ in range(4)]
            streams = [asyncio.create_task(_stream(client, f)) for f in firsts]
            wholes = [asyncio.create_task(_whole(client)) for _ in range(2)]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 60)
            for _ in range(600):  # until the engine holds all six (the whole ones send no early sign)
                m = await asyncio.to_thread(read_metrics, server.url)
                if m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] == 6:
                    break
                await asyncio.sleep(0.05)
            start = time.monotonic()
            server.proc.send_signal(sig)
            await asyncio.get_running_loop().run_in_executor(None, server.proc.wait, 30)
            exit_s = time.monotonic() - start
            return exit_s, await asyncio.gather(*streams), await asyncio.gather(*wholes)
    exit_s, streams, wholes = asyncio.run(run())
    assert exit_s < EXIT_LIMIT_S
    assert server.proc.returncode == 0
    assert set(streams) <= {"error", "done"}, streams  # an error event or a complete stream, never cut silently
    assert set(wholes) <= {200, 503}, wholes
    err = server.stderr()
    assert "Traceback" not in err, err[-3000:]


def _stalled_stream(server, max_tokens: int = 4000, n: int = 4) -> socket.socket:
    """A streaming request on a raw socket with a tiny receive window, never read; n = 4 samples with top-20
    logprobs make each step's events about 4 KB, so the server's kernel buffers (4 MB at most) fill soon."""
    body = json.dumps({**BODY, "max_tokens": max_tokens, "stream": True, "logprobs": 20, "n": n,
                       "temperature": 0.7, "seed": 0}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", server.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


def _wait_until_sends_block(server, read_metrics, limit_s: float = 240) -> None:
    """The server times each token as its stream pulls it; a stream blocked on a full socket pulls none, so the
    count stops while the request still runs."""
    last, since, deadline = -1.0, time.monotonic(), time.monotonic() + limit_s
    while time.monotonic() < deadline:
        m = read_metrics(server.url)
        count = m["vllm:inter_token_latency_seconds_count"]
        assert m["vllm:num_requests_running"] > 0 or count == 0, "the request finished before its sends blocked"
        if count != last:
            last, since = count, time.monotonic()
        elif count > 0 and time.monotonic() - since > 3:
            return
        time.sleep(0.5)
    raise AssertionError("the server's sends never blocked")


def test_sigterm_with_a_client_that_stopped_reading_is_prompt_and_quiet(start_server, read_metrics):
    server = start_server("--max-model-len", "4096", "--shutdown-timeout", "0")
    stalled = _stalled_stream(server, n=16)  # 16 KB of events a step: the buffers fill 4x sooner
    _wait_until_sends_block(server, read_metrics)
    exit_s = server.stop(signal.SIGTERM)
    stalled.close()
    assert server.proc.returncode == 0
    assert exit_s < 4, f"exit took {exit_s:.1f} s"
    err = server.stderr()
    assert "Traceback" not in err and "without completing" not in err, err[-3000:]


def test_two_quick_sigints_exit_quietly(start_server):
    server = start_server()
    server.proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    server.proc.send_signal(signal.SIGINT)
    assert server.stop(timeout=15) < 15
    assert "Traceback" not in server.stderr(), server.stderr()[-3000:]


def test_sigint_while_loading_is_one_line(tmp_path):
    out, err = open(tmp_path / "out", "w+"), open(tmp_path / "err", "w+")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--port", "0"],
                            stdout=out, stderr=err, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while "INFO" not in Path(err.name).read_text() and time.monotonic() < deadline:  # loading has begun
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130, Path(err.name).read_text()[-3000:]
    finally:
        if proc.poll() is None:  # a failed run leaves no server behind
            proc.kill()
            proc.wait()
    text = Path(err.name).read_text()
    assert "Traceback" not in text and "interrupted" in text, text[-3000:]


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return out


def _engine_core(pid: int) -> list[int]:
    """The children of pid that are multiprocessing's spawned interpreters (the engine core), not the short-lived
    helpers imports run (ctypes' find_library spawns /sbin/ldconfig while torch loads)."""
    out = []
    for child in _children(pid):
        try:
            if b"multiprocessing" in Path(f"/proc/{child}/cmdline").read_bytes():
                out.append(child)
        except OSError:  # gone meanwhile
            continue
    return out


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
@pytest.mark.parametrize("api_servers", ["1", "2"])
def test_ctrl_c_while_the_engine_core_loads_leaves_no_process(tmp_path, api_servers):
    """A terminal's Ctrl-C reaches the whole process group, the engine core process included, while it loads
    the model: the server exits with 130 and nothing of the group is left running (with --api-server-count 2
    the launcher loads the core before it starts the servers)."""
    out, err = open(tmp_path / "out", "w+"), open(tmp_path / "err", "w+")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--port", "0",
                             "--api-server-count", api_servers],
                            stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not _engine_core(proc.pid) and time.monotonic() < deadline:  # the core process is spawned
            time.sleep(0.02)
        assert _engine_core(proc.pid), "the engine core process never started"
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 130, Path(err.name).read_text()[-3000:]
        deadline = time.monotonic() + 10
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _group_alive(proc.pid), "a process of the server's group outlived it"
        assert "vllm API server ready" not in Path(out.name).read_text(), "the signal came after loading"
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        out.close()
        err.close()


def test_a_port_in_use_is_reported_before_the_model_loads(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--port", str(port)],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    # The default bind is every interface (upstream's), which a listener on 127.0.0.1 already blocks.
    assert f"cannot listen on 0.0.0.0:{port}: Address already in use" in result.stderr
    assert "Loading safetensors" not in result.stderr and "attention backends" not in result.stderr


def _stream_after_signals(server, *signals: int) -> list[dict]:
    """A streamed completion that has begun when the signals are sent; its chunks (an error is a chunk too)."""
    with httpx.Client(base_url=server.url, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json={**BODY, "max_tokens": 64, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            for sig in signals:
                server.proc.send_signal(sig)
                time.sleep(0.2)
            rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in [first, *rest[:-1]]]


def test_sigterm_drains_by_default(start_server):
    """No flag: SIGTERM lets the stream finish whole (upstream's default would abort it)."""
    server = start_server()
    chunks = _stream_after_signals(server, signal.SIGTERM)
    assert not any("error" in c for c in chunks), ([c for c in chunks if "error" in c], server.stderr()[-2000:])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(30) == 0
    assert "draining: requests in flight have 20 s to finish" in server.stderr()


def test_a_second_signal_during_the_drain_aborts_at_once(start_server):
    server = start_server("--max-model-len", "4096")
    start = time.monotonic()
    with httpx.Client(base_url=server.url, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json={**BODY, "max_tokens": 4000, "stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            server.proc.send_signal(signal.SIGINT)
            last = [line for line in lines if line.startswith("data: ")][-2]
    assert "error" in json.loads(last[6:])  # aborted, not finished: 4000 tokens take far longer
    assert server.proc.wait(30) == 0
    assert time.monotonic() - start < EXIT_LIMIT_S + 5
    assert "a second signal: aborting the requests still in flight" in server.stderr()


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
def test_the_server_exits_non_zero_when_its_engine_core_dies(start_server):
    server = start_server()
    core = max(_engine_core(server.proc.pid), key=_rss_kb)  # the one that holds the model
    os.kill(core, signal.SIGKILL)
    assert server.proc.wait(30) == 1
    err = server.stderr()
    assert "the engine process died (exit code -9); its log says why: the API server exits (code 1) so that its " \
           "supervisor can restart it" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
