"""The load generator's own CPU per streamed request, by HTTP client library (aiohttp, what `vllm bench serve`
uses as upstream's does, against httpx, what it used before), on a stub server that answers at once.

    python benchmarks/bench_http_client.py --requests 3000 --concurrency 16 --tokens 3

The stub (a raw asyncio server in its own process) answers every POST with --tokens SSE chunks, a usage chunk and
[DONE], chunked; each client sends a 256-id prompt body and parses every data line, as one_request does. Prints
the client process's CPU per request, median of --repeats runs per library, alternating.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import socket
import statistics
import time


def stub_server(sock: socket.socket, tokens: int) -> None:
    event = b'data: {"choices":[{"text":"a","logprobs":{"tokens":["a"]}}]}\n\n'
    events = [event] * tokens + [b'data: {"choices":[],"usage":{"completion_tokens":%d}}\n\n' % tokens,
                                 b"data: [DONE]\n\n"]
    reply = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
             + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n")

    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                writer.write(reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main():
        server = await asyncio.start_server(handle, sock=sock)
        await server.serve_forever()
    asyncio.run(main())


async def load(library: str, url: str, requests: int, concurrency: int) -> None:
    body = {"model": "m", "prompt": [random.randrange(5, 160000) for _ in range(256)], "max_tokens": 3,
            "stream": True, "logprobs": 0}
    sem = asyncio.Semaphore(concurrency)
    if library == "httpx":
        import httpx
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=None, limits=limits, trust_env=False) as client:
            async def one():
                async with sem, client.stream("POST", url, json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data:") and "[DONE]" not in line:
                            json.loads(line[5:])
            await asyncio.gather(*(one() for _ in range(requests)))
    else:
        import aiohttp
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), trust_env=False) as session:
            async def one():
                async with sem, session.post(url, json=body) as r:
                    async for raw in r.content:
                        if raw.startswith(b"data:") and b"[DONE]" not in raw:
                            json.loads(raw[5:])
            await asyncio.gather(*(one() for _ in range(requests)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions"
    server = multiprocessing.get_context("fork").Process(target=stub_server, args=(sock, args.tokens), daemon=True)
    server.start()
    cpu: dict[str, list[float]] = {"aiohttp": [], "httpx": []}
    try:
        for _ in range(args.repeats):
            for library in cpu:
                c0 = time.process_time()
                asyncio.run(load(library, url, args.requests, args.concurrency))
                cpu[library].append((time.process_time() - c0) / args.requests * 1e6)
    finally:
        server.kill()
    for library, us in cpu.items():
        print(f"{library:8s} client CPU per request: median {statistics.median(us):7.0f} us "
              f"(runs: {', '.join(f'{x:.0f}' for x in us)})")


if __name__ == "__main__":
    main()
