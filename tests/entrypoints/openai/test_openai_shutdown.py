"""SIGTERM / SIGINT with requests in flight: the process exits within seconds, cleanly, and every client gets
either its answer or an error (never a hang)."""
from __future__ import annotations

import asyncio
import json
import signal
import time

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
    server = start_server()

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
