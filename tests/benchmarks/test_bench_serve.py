"""benchmarks/bench_serve.py against a stub OpenAI-style streaming server started in the test (no real engine)."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import benchmark_scripts
import pytest

bench_serve = benchmark_scripts.load("bench_serve")


class Stub(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, fail_every: int = 0, delay: float = 0.002, usage: bool = True, no_text: bool = False):
        super().__init__(("127.0.0.1", 0), Handler)
        self.fail_every, self.delay, self.usage, self.no_text = fail_every, delay, usage, no_text
        self.count, self.lock, self.bodies = 0, threading.Lock(), []
        self.in_flight = self.max_in_flight = 0


class Handler(BaseHTTPRequestHandler):
    server: Stub

    def log_message(self, *args):  # keep pytest output clean
        pass

    def send_json(self, code: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [{"id": "stub-model", "object": "model"}]})
        else:
            self.send_json(404, {"error": "not found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv = self.server
        with srv.lock:
            srv.count += 1
            n = srv.count
            srv.bodies.append(body)
        if self.path != "/v1/completions" or (srv.fail_every and n % srv.fail_every == 0):
            self.send_json(400, {"error": {"message": "stub refuses this one", "type": "BadRequestError"}})
            return
        with srv.lock:
            srv.in_flight += 1
            srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
        try:
            self.stream(body)
        finally:
            with srv.lock:
                srv.in_flight -= 1

    def stream(self, body: dict) -> None:
        srv = self.server
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()

        def event(obj) -> None:
            self.wfile.write(f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode())
            self.wfile.flush()

        try:
            plen = len(body["prompt"]) if isinstance(body["prompt"], list) else len(body["prompt"].split())
            for i in range(body["max_tokens"]):
                time.sleep(srv.delay)
                # no_text: tokens that decode to nothing, as a random model's do; the token shows in logprobs only
                lps = {"tokens": [f"<{i}>"], "token_logprobs": [-1.0]} if "logprobs" in body else None
                event({"id": "cmpl-1", "object": "text_completion", "model": body["model"],
                       "choices": [{"index": 0, "text": "" if srv.no_text else f" t{i}", "logprobs": lps,
                                    "finish_reason": "length" if i == body["max_tokens"] - 1 else None}]})
            if srv.usage:
                event({"id": "cmpl-1", "object": "text_completion", "model": body["model"], "choices": [],
                       "usage": {"prompt_tokens": plen, "completion_tokens": body["max_tokens"],
                                 "total_tokens": plen + body["max_tokens"]}})
            event("[DONE]")
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
            pass


@pytest.fixture
def stub(request):
    srv = Stub(**getattr(request, "param", {}))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def url(srv: Stub) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


def check_ordered(s: dict) -> None:
    assert s["n"] > 0
    assert s["min"] <= s["median"] <= s["p90"] <= s["p99"] <= s["max"]
    assert s["min"] <= s["mean"] <= s["max"]


@pytest.mark.parametrize("stub", [{"fail_every": 4}], indirect=True)
def test_stub_run_counts_failures_and_orders_metrics(stub, tmp_path):
    out = tmp_path / "serve.json"
    res = bench_serve.main(["--base-url", url(stub), "--num-prompts", "12", "--max-concurrency", "4",
                            "--input-len", "8", "--output-len", "6", "--out", str(out)])
    s = res["summary"]
    assert s["completed"] == 9 and s["failed"] == 3
    assert any("HTTP 400" in e and "stub refuses" in e for e in s["errors"])
    assert s["request_throughput"] > 0 and s["output_token_throughput"] > 0
    assert s["total_output_tokens"] == 9 * 6 and s["total_input_tokens"] == 9 * 8
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        check_ordered(s[key])
    assert s["itl_ms"]["n"] == 9 * 5 and s["tpot_ms"]["n"] == 9
    for r in res["requests"]:
        if r["error"] is None:
            assert 0 < r["ttft"] <= r["e2e"] and r["output_tokens"] == 6
    assert s["ttft_ms"]["median"] <= s["e2e_ms"]["median"]
    # what the server was sent, and what was written
    assert res["config"]["model"] == "stub-model"
    b = stub.bodies[0]
    assert b["stream"] is True and b["ignore_eos"] is True and b["temperature"] == 0 and b["max_tokens"] == 6
    assert b["stream_options"] == {"include_usage": True}
    assert len(b["prompt"]) == 8 and all(5 <= t < 500 for t in b["prompt"])
    on_disk = json.loads(out.read_text())
    assert on_disk["summary"]["completed"] == 9 and "git_commit" in on_disk and "argv" in on_disk
    assert on_disk["config"]["request_rate"] == "inf"
    assert out.with_suffix(".png").stat().st_size > 1000


@pytest.mark.parametrize("stub", [{"usage": False}], indirect=True)
def test_poisson_dataset_ranges_and_chunk_count_without_usage(stub, tmp_path):
    text = tmp_path / "words.txt"
    text.write_text(" ".join(f"w{i}" for i in range(200)))
    res = bench_serve.main(["--base-url", url(stub).replace("127.0.0.1", "localhost"), "--model", "named",
                            "--num-prompts", "8", "--request-rate", "200", "--dataset", str(text), "--input-len",
                            "10", "--output-len", "4", "--range-ratio", "0.5", "--seed", "3",
                            "--out", str(tmp_path / "o.json")])
    s = res["summary"]
    assert s["completed"] == 8 and s["failed"] == 0
    assert all(r["output_tokens"] == r["max_tokens"] == r["chunks"] for r in res["requests"])
    assert all(5 <= r["prompt_len"] <= 15 and 2 <= r["max_tokens"] <= 6 for r in res["requests"])
    assert all(isinstance(b["prompt"], str) and b["model"] == "named" for b in stub.bodies)


@pytest.mark.parametrize("stub", [{"delay": 0.05}], indirect=True)
def test_total_timeout_counts_unfinished(stub, tmp_path):
    t0 = time.perf_counter()
    res = bench_serve.main(["--base-url", url(stub), "--num-prompts", "4", "--output-len", "40", "--timeout", "0.3",
                            "--out", str(tmp_path / "t.json")])
    assert time.perf_counter() - t0 < 10
    assert res["summary"]["completed"] == 0 and res["summary"]["failed"] == 4
    assert any("not finished within the timeout" in e for e in res["summary"]["errors"])


@pytest.mark.parametrize("bad", ["http://10.0.0.1:8000", "http://example.com", "http://0.0.0.0:8000",
                                 "ftp://127.0.0.1:8000"])
def test_non_loopback_refused(bad, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench_serve.main(["--base-url", bad, "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2
    assert "loopback" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("good", ["http://127.0.0.1:1", "http://127.5.6.7:8000/", "http://localhost:8000",
                                  "http://[::1]:8000"])
def test_loopback_accepted(good):
    assert bench_serve.check_loopback(good) == good.rstrip("/")


@pytest.mark.parametrize("stub", [{"no_text": True}], indirect=True)
def test_every_token_times_tokens_that_have_no_text(stub, tmp_path):
    common = ["--base-url", url(stub), "--num-prompts", "4", "--input-len", "8", "--output-len", "5"]
    blind = bench_serve.main(common + ["--out", str(tmp_path / "a.json")])["summary"]
    assert blind["completed"] == 0 and blind["errors"] == {"no non-empty text chunk": 4}
    res = bench_serve.main(common + ["--every-token", "--out", str(tmp_path / "b.json")])
    s = res["summary"]
    assert s["completed"] == 4 and s["itl_ms"]["n"] == 4 * 4 and s["total_output_tokens"] == 4 * 5
    assert all(b.get("logprobs") == 0 for b in stub.bodies[4:]) and "logprobs" not in stub.bodies[0]


def test_requests_spread_over_client_processes(stub, tmp_path):
    """--client-processes 3: every request runs once, records come back in prompt order, and the clients' CPU
    time is reported."""
    res = bench_serve.main(["--base-url", url(stub), "--num-prompts", "10", "--max-concurrency", "5",
                            "--input-len", "8", "--output-len", "4", "--range-ratio", "0.5", "--seed", "7",
                            "--client-processes", "3", "--out", str(tmp_path / "p.json")])
    s = res["summary"]
    assert s["completed"] == 10 and s["failed"] == 0 and len(stub.bodies) == 10
    import random

    from vllm.benchmarks.serve import make_prompts
    expected = make_prompts(10, 8, 4, 0.5, 500, random.Random(7))
    assert [(r["prompt_len"], r["max_tokens"]) for r in res["requests"]] == [(n, m) for _, n, m in expected]
    sent = sorted(tuple(b["prompt"]) for b in stub.bodies)
    assert sent == sorted(tuple(p) for p, _, _ in expected), "each prompt sent exactly once"
    client = s["client"]
    assert client["processes"] == 3 and client["cpu_s"] > 0 and 0 < client["max_process_cpu_util"]
    assert s["duration_s"] > 0 and s["ttft_ms"]["n"] == 10


@pytest.mark.parametrize("stub", [{"delay": 0.03}], indirect=True)
def test_client_processes_start_together(stub, tmp_path):
    """Client processes import at different speeds: they wait for each other before the first request, so the
    load reaches max_concurrency at once and the wall time does not count one process's head start."""
    res = bench_serve.main(["--base-url", url(stub), "--num-prompts", "6", "--max-concurrency", "6",
                            "--input-len", "8", "--output-len", "10", "--client-processes", "3",
                            "--out", str(tmp_path / "t.json")])
    assert res["summary"]["completed"] == 6 and stub.max_in_flight == 6
    firsts = [min(r["start"] for r in res["requests"][i::3]) for i in range(3)]
    assert max(firsts) - min(firsts) < 0.1, f"processes started {max(firsts) - min(firsts):.2f} s apart"
