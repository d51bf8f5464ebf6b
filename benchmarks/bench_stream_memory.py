"""Server memory for streams whose clients stop reading, against the same streams read promptly.

    python benchmarks/bench_stream_memory.py --streams 2 --max-tokens 4000 \
        --out benchmarks/results/cpu/stream_memory.json

Starts `vllm serve` (the built-in model) on a free 127.0.0.1 port. For each mode, opens --streams streaming
completions (n = 4 samples) of exactly --max-tokens tokens with top-20 logprobs (about 4 KB a step, so the
stream outgrows the kernel's socket buffers and the server's sends really block), each mode on a fresh server
after a warm-up request: "read" consumes every event as it comes; "stalled" sends the request
on a raw socket and reads nothing until the server has finished generating (all requests done, from /metrics).
The server's RSS (/proc/PID/status) is sampled throughout; the report gives its growth over the idle baseline,
peak and after, per mode, plus the bytes each stalled client finally received (what was held for it).
"""
from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import metadata, write_json  # noqa: E402
from fuzz_server import KEY, start_server  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class Sampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0.0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, rss_mib(self.pid))
            time.sleep(0.05)


# Top-20 logprobs for n = 4 samples: each step's events carry ~4 KB, so a few thousand tokens outgrow the
# kernel's socket buffers (several MB on loopback) and the server's sends really block.
LOGPROBS, N = 20, 4


def body(max_tokens: int) -> dict:
    return {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0.7, "seed": 0, "n": N,
            "ignore_eos": True, "stream": True, "logprobs": LOGPROBS}


def read_streams(url: str, n: int, max_tokens: int) -> list[int]:
    def one(out: list, i: int) -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body(max_tokens), headers=AUTH, timeout=None) as r:
            r.raise_for_status()
            out[i] = sum(len(chunk) for chunk in r.iter_bytes())
    sizes = [0] * n
    threads = [threading.Thread(target=one, args=(sizes, i)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sizes


def stalled_streams(url: str, n: int, max_tokens: int) -> list[int]:
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body(max_tokens)).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Authorization: {AUTH['Authorization']}\r\n"
               f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode() + payload
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window, so the
        s.connect((host, int(port)))  # server's sends block soon and what it holds is its own memory
        s.sendall(request)
        socks.append(s)
    time.sleep(1.0)
    while True:  # the engine keeps generating; wait until it is done with every request
        m = httpx.get(url + "/metrics", timeout=10).text
        running = sum(float(line.split()[-1]) for line in m.splitlines()
                      if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))
        if running == 0:
            break
        time.sleep(0.2)
    sizes = []
    for s in socks:  # now read everything that was held for the client
        total = 0
        while chunk := s.recv(1 << 16):
            total += len(chunk)
        s.close()
        sizes.append(total)
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=4000)
    ap.add_argument("--out", default="benchmarks/results/cpu/stream_memory.json")
    args = ap.parse_args()
    report = {"meta": metadata("cpu"), "streams": args.streams, "max_tokens": args.max_tokens, "n": N,
              "logprobs": LOGPROBS, "modes": {}}
    for mode, run in (("read", read_streams), ("stalled", stalled_streams)):
        proc, url = start_server(["--max-model-len", str(args.max_tokens + 64)])
        try:
            read_streams(url, 1, 64)  # warm-up: one-time allocations are not the stream's
            base = rss_mib(proc.pid)
            sampler = Sampler(proc.pid)
            sampler.start()
            start = time.monotonic()
            sizes = run(url, args.streams, args.max_tokens)
            sampler.stop.set()
            sampler.join()
            report["modes"][mode] = {"baseline_mib": base, "peak_growth_mib": sampler.peak - base,
                                     "after_growth_mib": rss_mib(proc.pid) - base, "seconds": time.monotonic() - start,
                                     "bytes_received_per_stream": sizes}
            print(mode, json.dumps(report["modes"][mode]), flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    write_json(args.out, report)


if __name__ == "__main__":
    main()
