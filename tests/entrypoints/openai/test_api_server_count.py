"""`vllm serve --api-server-count 2`: two API server processes over one engine core answer as one server (greedy
outputs equal offline, both processes serve, /metrics sums both whichever answers the scrape, a stored response is
continued and read through either); SIGTERM drains
both and leaves no process; a server, the core or the launcher that dies takes the whole server down with no
process left behind."""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from vllm import SamplingParams

PROMPTS = [f"Request number {i} says" for i in range(24)]
MAX_TOKENS = 8


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def api_servers(launcher_pid: int) -> list[int]:
    """The launcher's children that lead process groups of their own: the API servers."""
    return [p for p in descendants(launcher_pid) if os.getpgid(p) == p and Path(f"/proc/{p}/stat").exists()]


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def wait_gone(pids: list[int], timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in _state(p)]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def complete(url: str, prompt: str, **kw) -> dict:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **kw}
    return httpx.post(url + "/v1/completions", json=body, timeout=120).json()  # a new connection each


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--api-server-count", "2")


def test_two_api_servers_answer_as_one_server(server, offline_llm, read_metrics):
    deadline = time.monotonic() + 60  # /health answers once the first server listens; the line waits for both
    while "(2 API server processes)" not in server.stdout() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "(2 API server processes)" in server.stdout()
    workers = api_servers(server.proc.pid)
    assert len(workers) == 2
    before = [cpu_ticks(p) for p in workers]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda p: complete(server.url, p), PROMPTS))
    after = [cpu_ticks(p) for p in workers]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    expected = [o.outputs[0].text for o in offline_llm.generate(PROMPTS, greedy, use_tqdm=False)]
    assert [a["choices"][0]["text"] for a in answers] == expected
    assert all(a > b for a, b in zip(after, before)), (before, after)  # both processes took requests
    for _ in range(4):  # whichever process answers the scrape, it counts every process's requests
        m = read_metrics(server.url)
        assert m["vllm:request_success_total"] == len(PROMPTS)
        assert m["vllm:e2e_request_latency_seconds_count"] == len(PROMPTS)
    assert m["vllm:num_requests_running"] == 0  # the engine's own, from the one core
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 200


def test_stored_responses_are_found_through_every_server(server):
    """Each call is a new connection, so it may reach either process; a response stored by one is continued and
    read through both (with one process's memory store, about half of these would be 404s)."""
    def post(**kw) -> dict:
        r = httpx.post(server.url + "/v1/responses", json={"max_output_tokens": 4, "temperature": 0, **kw}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()
    last = post(input="Hello")
    for i in range(6):
        last = post(input=f"And then {i}?", previous_response_id=last["id"])
        got = httpx.get(f"{server.url}/v1/responses/{last['id']}", timeout=60)
        assert got.status_code == 200 and got.json()["id"] == last["id"], got.text
    assert last["previous_response_id"] is not None and last["status"] in ("completed", "incomplete")


def test_sigterm_drains_every_server_and_leaves_no_process(server):
    """Ends the module's server (the tests above use it)."""
    s = server
    procs = descendants(s.proc.pid)
    environ = Path(f"/proc/{api_servers(s.proc.pid)[0]}/environ").read_bytes().split(b"\0")
    setting = next(e for e in environ if e.startswith(b"PROMETHEUS_MULTIPROC_DIR="))
    metrics_dir = Path(setting.split(b"=", 1)[1].decode())
    assert metrics_dir.is_dir()
    with httpx.stream("POST", s.url + "/v1/completions", timeout=120,
                      json={"prompt": "Hi", "max_tokens": 60, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        s.proc.send_signal(signal.SIGTERM)
        events = [first] + [line for line in lines if line.startswith("data:")]
    chunks = [json.loads(e[5:]) for e in events if e != "data: [DONE]"]
    assert events[-1] == "data: [DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert s.proc.wait(60) == 0
    assert wait_gone(procs) == []
    assert not metrics_dir.exists()  # the launcher removed it


def engine_core(launcher_pid: int) -> int:
    servers = api_servers(launcher_pid)
    (core,) = [p for p in descendants(launcher_pid) if p not in servers and Path(f"/proc/{p}").exists()
               and b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()
               and int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]) == launcher_pid]
    return core


@pytest.mark.parametrize("victim", ["api_server", "engine_core", "launcher"])
def test_a_dead_process_takes_the_whole_server_down(start_server, victim):
    """A server that dies: the launcher stops the other and exits 1 (a supervisor restarts the whole). The core
    that dies: every server exits 1, and so does the launcher. A launcher that dies: its servers get SIGTERM and
    the core exits after them."""
    s = start_server("--api-server-count", "2")
    procs = descendants(s.proc.pid)
    target = {"api_server": lambda: api_servers(s.proc.pid)[0], "engine_core": lambda: engine_core(s.proc.pid),
              "launcher": lambda: s.proc.pid}[victim]()
    os.kill(target, signal.SIGKILL)
    code = s.proc.wait(60)
    assert code == (-signal.SIGKILL if victim == "launcher" else 1)
    assert wait_gone(procs) == []
    if victim == "api_server":
        assert "exited (code -9) while serving" in s.stderr()
    if victim == "engine_core":
        assert "engine process died" in s.stderr()
