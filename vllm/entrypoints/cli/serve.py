"""`vllm serve [MODEL]`: the OpenAI-compatible HTTP server (vllm/entrypoints/openai/) on one engine."""
from __future__ import annotations

import argparse
import os
import socket

from vllm.engine.arg_utils import EngineArgs

API_KEY_ENV = "VLLM_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server",
                       description="Serve /v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
                                   "/detokenize, /health, /version and /metrics over HTTP.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="model directory (same as --model; default: the built-in tiny Kimi-K3)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the name(s) clients pass as `model` (default: the model path); the first is reported")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV} if set)")
    p.add_argument("--max-log-len", type=int, default=None,
                   help="log at most this many prompt characters (or token ids) per request")
    p.add_argument("--disable-log-requests", action="store_true", help="do not log each request")
    p.add_argument("--uvicorn-log-level", default="info", choices=LOG_LEVELS)
    p.add_argument("--max-request-body-bytes", type=int, default=1 << 20,
                   help="larger request bodies are refused with 413 (default: 1 MiB)")
    EngineArgs.add_cli_args(p)


def run(args: argparse.Namespace) -> int:
    if args.model_tag is not None:
        if args.model not in (EngineArgs.model, args.model_tag):
            raise ValueError(f"the model is given twice, as {args.model_tag!r} and --model={args.model!r}: "
                             "give one")
        args.model = args.model_tag
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port={args.port} is invalid: expected 0..65535")
    if args.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes={args.max_request_body_bytes} is invalid: expected >= 1")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len={args.max_log_len} is invalid: expected >= 0")
    # The port first: a port in use is reported in a second, not after the model has loaded.
    sock = bind_socket(args.host, args.port)
    # Heavy imports only once the arguments are known to be good (`vllm --help` stays fast).
    from vllm.engine.async_llm import AsyncLLM
    from vllm.entrypoints.openai.api_server import run_server
    from vllm.entrypoints.openai.serving_engine import ServerSettings

    settings = ServerSettings(served_model_names=args.served_model_name or [args.model],
                              max_log_len=args.max_log_len, log_requests=not args.disable_log_requests,
                              max_body_bytes=args.max_request_body_bytes,
                              api_key=args.api_key or os.environ.get(API_KEY_ENV) or None)
    with sock:
        engine = AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args))
        return run_server(engine, settings, sock, args.uvicorn_log_level)


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (listening starts with the server); ValueError if the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart over TIME_WAIT, not over a listener
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror} (is another server using --port {port}? "
                         "pick another with --port)") from None
    return sock
