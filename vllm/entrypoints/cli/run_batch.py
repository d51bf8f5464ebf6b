"""`vllm run-batch -i requests.jsonl -o results.jsonl [engine flags]`: OpenAI's batch file format, run offline
through the same endpoints `vllm serve` has (upstream's subcommand and flags).

Each input line is {"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions",
"body": {...}}; each output line, in input order, is {"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}. A bad line gets its error there and the others run. The requests run
concurrently in one engine, as a server's clients would, and go through the server's app in-process, so a body
means exactly what it means to `vllm serve`. Results are written (and flushed) as soon as every earlier line's
are, so a run stopped late keeps what it finished.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from pathlib import Path
from typing import TextIO

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
    lines = read_lines(args.input_file)
    # Opened before the engine loads, so an unwritable path fails in a second, not after the whole batch ran.
    try:
        out = open(args.output_file, "w", encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot write the output file {args.output_file}: {e.strerror or e}") from None
    with out:
        writer = OrderedWriter(out)
        asyncio.run(run_lines(lines, args, writer))
    print(f"{writer.written} requests, {writer.failed} failed: {args.output_file}")
    return 0


def read_lines(path: str) -> list[bytes]:
    """The non-blank lines as bytes: each is decoded on its own, so one bad line is that line's error. Split on
    newlines only (bytes.splitlines), never on U+2028 and the like, which JSON strings may hold raw."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the input file {path}: {e.strerror or e}") from None
    return [line for line in data.splitlines() if line.strip()]


class OrderedWriter:
    """Writes results in input order as soon as every earlier one is written, flushed, so a failure late in a
    run loses nothing already done."""

    def __init__(self, out: TextIO) -> None:
        self.out, self.ready, self.written, self.failed = out, {}, 0, 0

    def put(self, index: int, result: dict) -> None:
        self.ready[index] = result
        while self.written in self.ready:
            result = self.ready.pop(self.written)
            self.out.write(result_line(result))
            self.written += 1
            self.failed += result["error"] is not None
        self.out.flush()


def result_line(result: dict) -> str:
    """One JSON line; a line that echoes back what cannot be written (a lone surrogate, a custom_id nested too
    deeply) is escaped, or becomes an error that says so."""
    try:
        line = json.dumps(result, ensure_ascii=False)
        line.encode("utf-8")
    except UnicodeEncodeError:
        line = json.dumps(result)  # \ud800 escapes are valid JSON, but not UTF-8 text
    except (RecursionError, ValueError, TypeError) as e:
        line = json.dumps({"id": result["id"], "custom_id": None, "response": None,
                           "error": {"message": f"the result cannot be written as JSON: {type(e).__name__}"}})
    return line + "\n"


async def run_lines(lines: list[bytes], args: argparse.Namespace, writer: OrderedWriter) -> None:
    from vllm.engine.async_llm import AsyncLLM
    from vllm.entrypoints.openai.api_server import build_app
    from vllm.entrypoints.openai.serving_engine import ServerSettings

    engine = AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args))
    app = build_app(engine, ServerSettings(served_model_names=args.served_model_name or [args.model],
                                           log_requests=False, max_body_bytes=1 << 30))
    limit = asyncio.Semaphore(MAX_IN_FLIGHT)

    async def one(index: int, line: bytes) -> tuple[int, dict]:
        async with limit:
            return index, await run_line(app, line)
    tasks = [asyncio.ensure_future(one(i, line)) for i, line in enumerate(lines)]
    try:
        for done in asyncio.as_completed(tasks):
            writer.put(*await done)
    except OSError as e:  # the disk filled up, the file system went away: what was written stays
        raise ValueError(f"writing {args.output_file} failed after {writer.written} of {len(lines)} results: "
                         f"{e.strerror or e}") from None
    finally:
        for t in tasks:
            t.cancel()
        await engine.shutdown()


async def run_line(app, raw: bytes) -> dict:
    """The line's result; whatever goes wrong with it (bad UTF-8 or JSON, nesting too deep, a request the server
    refuses, an engine error) is this line's error and no other's."""
    out = {"id": f"vllm-{uuid.uuid4().hex}", "custom_id": None, "response": None, "error": None}
    try:
        url, body = parse_line(raw, out)
        status, response = await asgi_post(app, url, body)
    except RecursionError:
        out["error"] = {"message": "the line nests arrays or objects too deeply"}
        return out
    except ValueError as e:  # includes UnicodeDecodeError and json.JSONDecodeError
        out["error"] = {"message": str(e)}
        return out
    except Exception as e:  # noqa: BLE001 - a bug one line triggers must not end the batch
        out["error"] = {"message": f"{type(e).__name__}: {e}"}
        return out
    out["response"] = {"status_code": status, "request_id": response.get("id", out["id"]), "body": response}
    if status != 200:
        out["error"] = response.get("error")
    return out


def parse_line(raw: bytes, out: dict) -> tuple[str, dict]:
    """The line's url and body; sets out["custom_id"] as soon as it is known."""
    item = json.loads(raw.decode("utf-8"))
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
    return url, body


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
