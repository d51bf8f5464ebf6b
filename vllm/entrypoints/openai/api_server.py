"""The OpenAI-compatible HTTP server: a FastAPI app over one AsyncLLM, run by uvicorn.

Request bodies are read and parsed in request_body.py (every client mistake becomes one OpenAI-shaped error).
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response

from vllm.entrypoints.openai.metrics import Metrics
from vllm.entrypoints.openai.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                              TokenizeRequest)
from vllm.entrypoints.openai.response_store import response_store
from vllm.entrypoints.openai.responses_protocol import ResponsesRequest
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.request_body import parse_body, read_body, validate_body
from vllm.entrypoints.openai.serving_engine import ServerSettings
from vllm.entrypoints.openai.server import Server
from vllm.version import __version__

logger = logging.getLogger("vllm.entrypoints.openai")

GRACEFUL_SHUTDOWN_S = 5  # after the requests in flight end (or are aborted): bounds any straggler connection
_DRAIN_LIMIT = 64 << 20  # read (and drop) at most this much of an oversized body so the client sees the 413
# The routes --api-key leaves open: probes and monitoring, which carry no credentials and run no client input.
# Upstream guards only /v1 (and a few other prefixes); here every other route needs the key, since /tokenize,
# /invocations and the docs run or reveal as much as /v1 does.
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})


class Guard:
    """ASGI middleware: the API key on every route but OPEN_PATHS, and the body-size limit, answered before any
    route runs."""

    def __init__(self, app, settings: ServerSettings) -> None:
        self.app, self.settings = app, settings
        self.expected = settings.api_key.encode() if settings.api_key else None

    async def __call__(self, scope, receive, send) -> None:
        error = self.check(scope) if scope["type"] == "http" else None
        if error is None:
            if not (self.settings.enable_server_load_tracking and self.route_path(scope).startswith("/v1/")):
                return await self.app(scope, receive, send)
            state = scope["app"].state  # Starlette puts the app in the scope before its middleware runs
            state.server_load += 1
            try:
                return await self.app(scope, receive, send)
            finally:
                state.server_load -= 1
        if error.status == 413:  # a client still sending would get a reset instead of our answer
            drained, more = 0, True
            while more and drained < _DRAIN_LIMIT:
                msg = await receive()
                drained += len(msg.get("body", b""))
                more = msg.get("more_body", False) and msg["type"] == "http.request"
        await JSONResponse(error.body(), error.status)(scope, receive, send)

    def route_path(self, scope) -> str:
        """The path the routes see: a request through --root-path's prefix (/llm/v1/...) is still /v1/..., so
        the key and the other /v1 rules apply to it as well."""
        path, root = scope["path"], self.settings.root_path.rstrip("/")
        return path[len(root):] if root and path.startswith(root + "/") else path

    def check(self, scope) -> APIError | None:
        headers = dict(scope["headers"])
        path = self.route_path(scope)
        if path.startswith("/v1") and scope["app"].state.draining:
            return APIError(503, "the server is shutting down and takes no new requests")
        # A CORS preflight (OPTIONS) carries no credentials by design; the CORS middleware answers it.
        if self.expected is not None and path not in OPEN_PATHS and scope["method"] != "OPTIONS":
            scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.expected):
                return APIError(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.settings.max_body_bytes:
            return APIError(413, f"the request body ({int(length)} bytes) is over the limit of "
                                 f"{self.settings.max_body_bytes} bytes (--max-request-body-bytes)")
        return None


def build_app(engine, settings: ServerSettings) -> FastAPI:
    metrics = Metrics(engine, settings.served_model_names[0], settings.show_hidden_metrics)
    completion = OpenAIServingCompletion(engine, settings, metrics)
    chat = OpenAIServingChat(engine, settings, metrics)
    responses = OpenAIServingResponses(chat, response_store(settings.response_store_dir))
    limit = settings.max_body_bytes
    mc = engine.config.model_config

    def begin_shutdown() -> asyncio.Task:
        """In-flight requests end now (streams with an error event, others with 503) so shutdown is quick."""
        completion.shutting_down = chat.shutting_down = True
        chat.renderer.close()  # renders in flight end with 503; no renderer process outlives the server
        if app.state.shutdown_task is None:
            app.state.shutdown_task = asyncio.ensure_future(engine.shutdown())
        return app.state.shutdown_task

    def begin_drain() -> None:
        """--shutdown-timeout: new /v1 requests get 503 (and /health), those in flight go on; whatever is
        still running when the timeout ends is aborted as begin_shutdown does."""
        if app.state.draining:
            return
        app.state.draining = True
        logger.info("draining: requests in flight have %.0f s to finish", settings.shutdown_timeout_s)
        asyncio.get_running_loop().call_later(settings.shutdown_timeout_s, begin_shutdown)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        await chat.renderer.wait_ready()  # so that /health's 200 means a chat is rendered at once
        yield
        await begin_shutdown()

    docs = {} if settings.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="vllm OpenAI-compatible server", version=__version__, lifespan=lifespan,
                  root_path=settings.root_path, **docs)
    app.state.shutdown_task = None
    app.state.draining = False
    app.state.begin_drain = begin_drain
    app.state.server_load = 0  # requests to /v1/* in flight (--enable-server-load-tracking)
    app.state.begin_shutdown = begin_shutdown
    app.add_middleware(Guard, settings=settings)
    # Outermost, so preflights are answered before the key check; upstream's defaults (any origin, no cookies).
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_credentials=False, allow_methods=["*"],
                       allow_headers=["*"])

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        return await api_error(request, APIError(e.status_code, f"{e.detail}: {request.method} {request.url.path}"))

    @app.get("/health")
    async def health() -> Response:
        down = completion.shutting_down or app.state.draining or engine.errored
        return Response(status_code=503 if down else 200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "vllm", "root": mc.model,
                "parent": None, "max_model_len": mc.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(name) for name in settings.served_model_names]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict:
        completion.check_model(name)
        return model_card(name)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:  # SageMaker's health check
        return await health()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await completion.create(await parse_body(request, CompletionRequest, limit), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await chat.create(await parse_body(request, ChatCompletionRequest, limit), request)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await responses.create(await parse_body(request, ResponsesRequest, limit), request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict:
        return await responses.get(response_id)

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        """SageMaker's one route: a body with `messages` is a chat completion, one with `prompt` a completion."""
        body = await read_body(request, limit)
        if "messages" in body:
            return await chat.create(validate_body(body, ChatCompletionRequest), request)
        if "prompt" in body:
            return await completion.create(validate_body(body, CompletionRequest), request)
        raise APIError(400, "an /invocations body needs `messages` (a chat completion) or `prompt` (a completion)")

    if settings.enable_server_load_tracking:
        @app.get("/load")
        async def load() -> dict:
            return {"server_load": app.state.server_load}

    if settings.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info() -> dict:
            """What a client needs to rebuild the tokenizer (lm-eval's local-completions reads it)."""
            tok = engine.tokenizer
            info = {k: v for k, v in tok.init_kwargs.items() if isinstance(v, (str, int, float, bool, type(None)))}
            return {**info, "tokenizer_class": type(tok).__name__, "model_max_length": mc.max_model_len,
                    "chat_template": settings.chat_template or tok.chat_template,
                    "eos_token": tok.eos_token, "bos_token": tok.bos_token, "pad_token": tok.pad_token,
                    "vocab_size": len(tok)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """Upstream's: forgets the cached prompt prefixes (e.g. between benchmark runs); 409 if the engine could
        not, as upstream answers."""
        logger.info("resetting the prefix cache")
        if not await engine.reset_prefix_cache():
            raise APIError(409, "the prefix cache could not be reset")
        return Response(status_code=200)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        req = await parse_body(request, TokenizeRequest, limit)
        completion.check_model(req.model)
        # In a worker thread: tokenizing a long prompt must not stall the event loop (and /health with it).
        if req.prompt is not None:
            ids = await asyncio.to_thread(engine.tokenizer.encode, req.prompt,
                                          add_special_tokens=req.add_special_tokens is not False)
        elif req.add_special_tokens:  # the rendered conversation, with the tokenizer's BOS as well
            ids = await chat.prompt_ids(req, output="encoded")
        else:
            ids = await chat.prompt_ids(req)
        # token_strs is always there (null unless asked for), as upstream's response has it.
        return {"count": len(ids), "max_model_len": mc.max_model_len, "tokens": ids,
                "token_strs": engine.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req = await parse_body(request, DetokenizeRequest, limit)
        completion.check_model(req.model)
        vocab = mc.hf_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens hold ids outside the vocabulary [0, {vocab}): {bad[:5]}", "tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    return app


def run_server(engine, settings: ServerSettings, sock: socket.socket, log_level: str,
               on_ready: Callable[[str, int], None] | None = None) -> int:
    """Serves on `sock`, bound by the caller before the model loaded; `on_ready(host, port)` replaces the ready
    line."""
    app = build_app(engine, settings)
    # With --shutdown-timeout uvicorn waits that long for open connections (the requests draining) as well.
    config = uvicorn.Config(app, log_level=log_level, access_log=settings.access_log,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S + settings.shutdown_timeout_s)
    server = Server(config, app, engine, settings, on_ready)
    server.run(sockets=[sock])
    return server.exit_code


if __name__ == "__main__":  # upstream's `python -m vllm.entrypoints.openai.api_server --model ...`
    import sys

    from vllm.entrypoints.cli.main import main
    sys.exit(main(["serve", *sys.argv[1:]]))
