"""Bad-input fuzz against a real `vllm serve` on loopback: hundreds of kinds of bad request, each of which must get
a 4xx with an OpenAI-shaped error (or be accepted, where upstream accepts the value), while good streams running
at the same time keep their exact greedy text, and the server stays healthy.

    python benchmarks/fuzz_server.py --out benchmarks/results/cpu/fuzz_server.json

Without --base-url it starts `vllm serve` (the built-in model, with --api-key) on a free 127.0.0.1 port and stops
it at the end; with --base-url (loopback only) it uses that server and its --api-key. Exits 1 if any bad request
got a 5xx, a non-JSON error, or a good stream's text changed. tests/entrypoints/openai/test_openai_fuzz.py runs
the same cases in the CPU suite.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import metadata, write_json  # noqa: E402
from bench_serve import check_loopback  # noqa: E402

KEY = "fuzz-key"
GOOD = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
JSON = {"content-type": "application/json"}
# Values no sampling field takes (or that are out of every range), for every field of both endpoints.
BAD_VALUES = {"string": "5", "negative": -1, "huge": 2**64, "list": [1], "object": {"a": 1}, "bool": True,
              "float": 1.5, "too-big-float": 1e300, "surrogate": "\ud800", "nested": [[[[[]]]]]}
FIELDS = ("temperature", "top_p", "top_k", "min_p", "n", "max_tokens", "min_tokens", "seed", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "logprobs", "ignore_eos",
          "skip_special_tokens", "include_stop_str_in_output", "stream", "echo", "model", "user")
CHAT_FIELDS = ("messages", "max_completion_tokens", "logprobs", "top_logprobs", "add_generation_prompt")


def raw(body: bytes, headers: dict | None = None) -> dict:
    return {"content": body, "headers": {**JSON, **(headers or {})}}


def js(body, headers: dict | None = None) -> dict:
    """A JSON body with non-ASCII escaped, so lone surrogates travel as "\\ud800" (the client cannot UTF-8
    encode them)."""
    return raw(json.dumps(body).encode(), headers)


async def _chunks(*parts: bytes):
    """A body sent chunked (no Content-Length), as the async client streams it."""
    for p in parts:
        yield p


def cases() -> list[tuple[str, str, str, dict]]:
    """(kind, method, path, httpx request kwargs) for every bad request."""
    out = []
    for field in FIELDS:
        for name, value in BAD_VALUES.items():
            out.append((f"completion.{field}={name}", "POST", "/v1/completions", js({**GOOD, field: value})))
    for field in CHAT_FIELDS:
        for name, value in BAD_VALUES.items():
            out.append((f"chat.{field}={name}", "POST", "/v1/chat/completions", js({**CHAT, field: value})))
    prompts = {"empty": "", "empty-list": [], "mixed": ["a", 1], "oov-id": [1, 10**9], "negative-id": [-1],
               "too-long": [5] * 100_000, "deep": [[[[1]]]], "surrogate": "a\udfffb", "null": None}
    out += [(f"completion.prompt={k}", "POST", "/v1/completions", js({**GOOD, "prompt": v}))
            for k, v in prompts.items()]
    messages = {"bad-role": [{"role": "bot", "content": "x"}], "no-content": [{"role": "user"}],
                "int-content": [{"role": "user", "content": 5}], "image": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "x"}}]}], "surrogate": [
                    {"role": "user", "content": "\ud800"}], "not-a-list": {"role": "user", "content": "x"}}
    out += [(f"chat.messages={k}", "POST", "/v1/chat/completions", js({**CHAT, "messages": v}))
            for k, v in messages.items()]
    bodies = {"malformed": b'{"prompt": ', "nan": b'{"prompt": "x", "temperature": NaN}', "empty": b"",
              "array": b"[1, 2]", "string": b'"x"', "deep": b'{"prompt": "x", "stop": ' + b"[" * 30_000
              + b"]" * 30_000 + b"}", "surrogate-key": b'{"\\ud800": 1, "prompt": "x"}',
              "surrogate-model": b'{"prompt": "x", "model": "\\ud800"}', "not-utf8": b'{"prompt": "\xff\xfe"}',
              "duplicate-keys": b'{"prompt": "x", "prompt": 5}'}
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        out += [(f"{path}.body={k}", "POST", path, raw(v)) for k, v in bodies.items()]
    out += [
        ("content-type", "POST", "/v1/completions", {"content": b'{"prompt": "x"}',
                                                     "headers": {"content-type": "text/plain"}}),
        ("too-large", "POST", "/v1/completions", js({**GOOD, "prompt": "x" * 2_000_000})),
        ("too-large-chunked", "POST", "/v1/completions", {"content": _chunks(b'{"prompt": "', b"x" * 2_000_000,
                                                                             b'"}'), "headers": JSON}),
        ("tokenize.surrogate", "POST", "/tokenize", js({"prompt": "\ud800"})),
        ("tokenize.both", "POST", "/tokenize", js({"prompt": "x", "messages": CHAT["messages"]})),
        ("detokenize.oov", "POST", "/detokenize", js({"tokens": [10**12]})),
        ("detokenize.not-ints", "POST", "/detokenize", js({"tokens": ["a"]})),
        ("unknown-model", "POST", "/v1/completions", js({**GOOD, "model": "gpt-4"})),
        ("no-route", "GET", "/v1/nothing", {}),
        ("wrong-method", "GET", "/v1/completions", {}),
        ("no-key", "POST", "/v1/completions", js(GOOD, {"Authorization": ""})),
        ("wrong-key", "GET", "/v1/models", {"headers": {"Authorization": "Bearer wrong"}}),
        ("basic-auth", "GET", "/v1/models", {"headers": {"Authorization": f"Basic {KEY}"}}),
        ("stream-options-without-stream", "POST", "/v1/completions",
         js({**GOOD, "stream_options": {"include_usage": True}})),
        ("oov-stop-token-min-tokens", "POST", "/v1/completions",
         js({**GOOD, "stop_token_ids": [10**6], "min_tokens": 1})),
        ("huge-top-k-sampled", "POST", "/v1/completions", js({**GOOD, "temperature": 0.7, "top_k": 2**63})),
    ]
    return out + new_surface_cases()


def new_surface_cases() -> list[tuple[str, str, str, dict]]:
    """Issue 46's surfaces: request chat templates, keyless routes, beam search limits, long per-request lists."""
    looping = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    beam = {**GOOD, "use_beam_search": True, "n": 2, "max_tokens": 4}
    out = [(f"{where}.chat_template", "POST", path, js({**CHAT, "chat_template": looping}))
           for where, path in (("chat", "/v1/chat/completions"), ("tokenize", "/tokenize"))]
    out += [(f"{where}.chat_template_kwargs.{k}", "POST", path, js({**CHAT, "chat_template_kwargs": {k: v}}))
            for where, path in (("chat", "/v1/chat/completions"), ("tokenize", "/tokenize"))
            for k, v in (("return_tensors", "pt"), ("tokenize", False), ("chat_template", looping))]
    out += [(f"no-key{path}", "POST", path, js(body, {"Authorization": ""}))
            for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]}),
                               ("/invocations", GOOD))]
    out += [(f"beam.{k}", "POST", "/v1/completions", js({**beam, **v})) for k, v in {
        "max_tokens-over-max-model-len": {"max_tokens": 10**6}, "length_penalty=1e5": {"length_penalty": 1e5},
        "length_penalty=1e308": {"length_penalty": 1e308}, "length_penalty=-1e308": {"length_penalty": -1e308},
        "logprobs": {"logprobs": 2}}.items()]
    out += [(f"completion.{k}=200k", "POST", "/v1/completions", js({**GOOD, k: v})) for k, v in {
        "allowed_token_ids": [5] * 200_000, "logit_bias": {str(i): 1 for i in range(50_000)},
        "stop": ["x"] * 10_000, "bad_words": ["ab"] * 10_000}.items()]
    return out


def check(kind: str, response: httpx.Response) -> str | None:
    """Why this answer is wrong, or None: a 4xx with an OpenAI-shaped JSON error, or a 200 (accepted)."""
    if response.status_code >= 500:
        return f"{kind}: {response.status_code} {response.text[:300]}"
    if response.status_code == 200:
        return None
    try:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and error["code"] == response.status_code
    except Exception:  # noqa: BLE001 - any shape problem is the finding
        return f"{kind}: {response.status_code} without an OpenAI-shaped error: {response.text[:300]}"
    return None


async def _stream_text(client: httpx.AsyncClient) -> str:
    text = ""
    async with client.stream("POST", "/v1/completions", json={**GOOD, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    return text


async def fuzz(base_url: str, key: str, concurrency: int = 8, streams: int = 8) -> dict:
    """Runs every case (at most `concurrency` at once) while `streams` good streams run; returns the report."""
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120) as client:
        reference = await _stream_text(client)
        good = [asyncio.create_task(_stream_text(client)) for _ in range(streams)]
        sem = asyncio.Semaphore(concurrency)
        statuses: Counter = Counter()
        problems: list[str] = []

        async def one(kind, method, path, kwargs):
            async with sem:
                kw = dict(kwargs)
                kw["headers"] = {**headers, **kw.get("headers", {})}
                try:
                    r = await client.request(method, path, **kw)
                except httpx.HTTPError as e:
                    problems.append(f"{kind}: transport error {e!r}")
                    return
                statuses[r.status_code] += 1
                if (why := check(kind, r)) is not None:
                    problems.append(why)

        all_cases = cases()
        start = time.monotonic()
        await asyncio.gather(*(one(*c) for c in all_cases))
        texts = await asyncio.gather(*good)
        healthy = (await client.get("/health")).status_code == 200
        health_ms = await _health_during_huge_prompt(client)
    changed = sum(t != reference for t in texts)
    if changed:
        problems.append(f"{changed} of {streams} good streams changed their greedy text")
    if not healthy:
        problems.append("/health is not 200 after the fuzz")
    return {"kinds": len(all_cases), "statuses": dict(sorted(statuses.items())), "good_streams": streams,
            "good_streams_changed": changed, "seconds": time.monotonic() - start,
            "health_max_ms_while_tokenizing_900kb": health_ms, "problems": problems}


async def _health_during_huge_prompt(client: httpx.AsyncClient) -> float:
    """The slowest /health answer (ms) while a 900 KB text prompt is tokenized (it is then refused as too long)."""
    words = " ".join(f"word{i % 997}" for i in range(110_000))[:900_000]
    big = asyncio.create_task(client.post("/v1/completions", json={**GOOD, "prompt": words}))
    worst = 0.0
    while not big.done():
        t = time.monotonic()
        await client.get("/health")
        worst = max(worst, (time.monotonic() - t) * 1e3)
        await asyncio.sleep(0.01)
    await big
    return worst


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def start_server(extra: list[str], api_key: str | None = KEY, timeout: float = 300.0) -> tuple[subprocess.Popen, str]:
    """`vllm serve` on a free loopback port with `extra` flags, once /health answers; (process, base URL).

    A benchmark stopped by SIGTERM (timeout(1) on the device machine) exits through its `finally`, which stops
    the server: by default the signal would end this process at once and leave the server running."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    auth = ["--api-key", api_key] if api_key is not None else []
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port),
           *auth, "--disable-log-requests", "--uvicorn-log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"vllm serve did not become healthy within {timeout} s")


def stop_server(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM (the server drains), then SIGKILL if it has not exited within `timeout` seconds."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default=None, help="a running loopback server (default: start one)")
    ap.add_argument("--api-key", default=KEY)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results/cpu/fuzz_server.json")
    args = ap.parse_args()
    proc = None
    if args.base_url is None:
        proc, url = start_server(["--max-model-len", "512"])
    else:
        url = check_loopback(args.base_url)
    try:
        report = asyncio.run(fuzz(url, args.api_key, args.concurrency, args.streams))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    write_json(args.out, {"meta": metadata("cpu"), **report})
    print(json.dumps({k: v for k, v in report.items() if k != "problems"}), flush=True)
    for p in report["problems"]:
        print("PROBLEM", p)
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
