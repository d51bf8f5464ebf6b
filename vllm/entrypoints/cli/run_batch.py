"""`vllm run-batch -i requests.jsonl -o results.jsonl [engine flags]`: OpenAI's batch file format, run offline
through the same endpoints `vllm serve` has (upstream's subcommand and flags).

Each input line is {"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions",
"body": {...}}; each output line, in input order, is {"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}. A bad line gets its error there and the others run. The requests run
concurrently in one engine, as a server's clients would, and go through the server's app in-process, so a body
means exactly what it means to `vllm serve`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from pathlib import Path

from vllm.engine.arg_utils import EngineArgs

URLS = ("/v1/completions", "/v1/chat/completions")
MAX_IN_FLIGHT = 1024  # requests handed to the engine at once; its scheduler batches them


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run-batch", help="run an OpenAI batch file offline",
                       description=__doc__.split("\n\n")[1])
    p.add_argument("-i", "--input-file", required=True, help="JSONL of batch requests")
    p.add_argument("-o", "--output-file", required=True, help="JSONL of results, one per request, in order")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names the bodies' `model` may use (default: the model path)")
    EngineArgs.add_cli_args(p)


def run(args: argparse.Namespace) -> int:
    lines = Path(args.input_file).read_text().splitlines()
    results = asyncio.run(run_lines([line for line in lines if line.strip()], args))
    Path(args.output_file).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results))
    failed = sum(r["error"] is not None for r in results)
    print(f"{len(results)} requests, {failed} failed: {args.output_file}")
    return 0


async def run_lines(lines: list[str], args: argparse.Namespace) -> list[dict]:
    from vllm.engine.async_llm import AsyncLLM
    from vllm.entrypoints.openai.api_server import build_app
    from vllm.entrypoints.openai.serving_engine import ServerSettings

    engine = AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args))
    app = build_app(engine, ServerSettings(served_model_names=args.served_model_name or [args.model],
                                           log_requests=False, max_body_bytes=1 << 30))
    limit = asyncio.Semaphore(MAX_IN_FLIGHT)

    async def one(line: str) -> dict:
        async with limit:
            return await run_line(app, line)
    try:
        return await asyncio.gather(*(one(line) for line in lines))
    finally:
        await engine.shutdown()


async def run_line(app, line: str) -> dict:
    out = {"id": f"vllm-{uuid.uuid4().hex}", "custom_id": None, "response": None, "error": None}
    try:
        item = json.loads(line)
        if not isinstance(item, dict):
            raise ValueError("a batch line must be a JSON object")
        out["custom_id"] = item.get("custom_id")
        url, body = item.get("url"), item.get("body")
        if item.get("method", "POST") != "POST" or url not in URLS:
            raise ValueError(f"method and url must be POST and one of {', '.join(URLS)}, got "
                             f"{item.get('method')} {url}")
        if not isinstance(body, dict):
            raise ValueError("body must be a JSON object")
        if body.get("stream"):
            raise ValueError("stream is not supported in a batch")
    except ValueError as e:
        out["error"] = {"message": str(e)}
        return out
    status, response = await asgi_post(app, url, body)
    out["response"] = {"status_code": status, "request_id": response.get("id", out["id"]), "body": response}
    if status != 200:
        out["error"] = response.get("error")
    return out


async def asgi_post(app, path: str, body: dict) -> tuple[int, dict]:
    """One POST through the app's ASGI interface (its middleware, validation and handlers), in this process."""
    data = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
             "server": ("run-batch", 0), "client": ("run-batch", 0),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]}
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": data, "more_body": False}
        await asyncio.Event().wait()  # the client never leaves: the request runs to its end
        raise AssertionError("unreachable")

    status, chunks = 500, []

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
    await app(scope, receive, send)
    return status, json.loads(b"".join(chunks) or b"{}")
