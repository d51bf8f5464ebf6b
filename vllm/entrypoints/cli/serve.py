"""`vllm serve [MODEL]`: the OpenAI-compatible HTTP server (vllm/entrypoints/openai/) on one engine."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
from pathlib import Path

from vllm.engine.arg_compat import IGNORED, UNSUPPORTED, UpstreamArg, add_upstream_args, check_upstream_args, json_value
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import MAX_LOGPROBS

API_KEY_ENV = "VLLM_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# SIGTERM's drain: Kubernetes sends SIGKILL 30 s after SIGTERM by default, and stopping the engine core and
# closing connections after the drain takes a few seconds more (upstream's default, 0, aborts at once).
DRAIN_S = 20.0
MAX_API_SERVERS = 64


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server",
                       description="Serve /v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
                                   "/detokenize, /health, /version and /metrics over HTTP.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="model directory (same as --model; default: the built-in tiny Kimi-K3)")
    p.add_argument("--host", default="0.0.0.0",
                   help="address to listen on (default: every interface, as upstream; 127.0.0.1 for this machine)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the name(s) clients pass as `model` (default: the model path); the first is reported")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health, /ping, /metrics and "
                        f"/version (default: ${API_KEY_ENV} if set)")
    p.add_argument("--max-log-len", type=int, default=None,
                   help="log at most this many prompt characters (or token ids) per request")
    # Upstream's flags: requests are not logged unless asked for (logs_requests).
    p.add_argument("--enable-log-requests", action="store_true",
                   help="log each request's prompt (at most --max-log-len of it) and sampling parameters")
    p.add_argument("--disable-log-requests", action="store_true", help="do not log requests (the default)")
    p.add_argument("--uvicorn-log-level", default="info", choices=LOG_LEVELS)
    p.add_argument("--max-request-body-bytes", type=int, default=1 << 20,
                   help="larger request bodies are refused with 413 (default: 1 MiB)")
    p.add_argument("--root-path", default="", help="the path prefix a proxy serves this server under")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, or the template text) replacing the tokenizer's own")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat_template sent in a request (a template is code the server runs; off by "
                        "default, as upstream: such requests get 400)")
    p.add_argument("--chat-template-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a chat-template render running longer is stopped and the request gets 400 (default 10)")
    p.add_argument("--shutdown-timeout", type=float, default=DRAIN_S,
                   help="on SIGTERM, seconds to let requests in flight finish (new ones get 503) before the rest "
                        f"are aborted (default {DRAIN_S:g}; 0: abort at once, as SIGINT does)")
    p.add_argument("--api-server-count", type=int, default=1,
                   help="HTTP server processes over the one engine core, sharing the port (default 1): more when "
                        "one process's streaming, detokenization and response building is the limit")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='logprob tokens as "token_id:N" (requests may override with the field of that name)')
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details in responses")
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="every stream ends with a usage chunk, asked for or not")
    p.add_argument("--enable-server-load-tracking", action="store_true",
                   help="GET /load: the number of /v1 requests in flight")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true", help="GET /tokenizer_info")
    p.add_argument("--show-hidden-metrics-for-version", default=None, metavar="VERSION",
                   help="the previous minor version (e.g. 0.0): /metrics also shows the metrics deprecated since "
                        "(vllm:gpu_cache_usage_perc, vllm:gpu_prefix_cache_queries, vllm:gpu_prefix_cache_hits)")
    p.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access log line per request")
    p.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc nor /openapi.json")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model call tools on its own (tool_choice "auto"); needs --tool-call-parser')
    p.add_argument("--tool-call-parser", default=None, help="how tool calls are read from answers: kimi_k2")
    p.add_argument("--reasoning-parser", default=None,
                   help="how thinking is split from answers into reasoning_content: kimi_k2")
    add_upstream_args(p, SERVER_ARGS)
    EngineArgs.add_cli_args(p)


SERVER_ARGS = {a.name: a for a in [
    UpstreamArg("allowed_origins", IGNORED, "CORS allows any origin, as upstream's default", (), json_value),
    UpstreamArg("allowed_methods", IGNORED, "CORS allows any method, as upstream's default", (), json_value),
    UpstreamArg("allowed_headers", IGNORED, "CORS allows any header, as upstream's default", (), json_value),
    UpstreamArg("allow_credentials", IGNORED, "CORS requests carry no credentials", (), None),
    UpstreamArg("ssl_keyfile", UNSUPPORTED, "TLS is not built in; put a TLS proxy in front"),
    UpstreamArg("ssl_certfile", UNSUPPORTED, "TLS is not built in; put a TLS proxy in front"),
    UpstreamArg("uds", UNSUPPORTED, "the server listens on TCP only"),
    UpstreamArg("lora_modules", UNSUPPORTED, "LoRA adapters are not supported"),
    UpstreamArg("middleware", UNSUPPORTED, "extra ASGI middleware is not loaded"),
    UpstreamArg("response_role", UNSUPPORTED, "answers always have the role assistant", (), str,
                lambda v: v in (None, "assistant")),
    UpstreamArg("enable_request_id_headers", IGNORED, "responses carry their id in the body", (), None),
    UpstreamArg("disable_frontend_multiprocessing", IGNORED, "the HTTP server and the engine core are already "
                "in separate processes as they need", (), None),
    UpstreamArg("log_config_file", IGNORED, "logging is configured by VLLM_LOGGING_LEVEL", (), str),
]}


def run(args: argparse.Namespace) -> int:
    with contextlib.ExitStack() as loading:
        return _run(args, loading, loading.enter_context(remembered_interrupts()))


def _run(args: argparse.Namespace, loading: contextlib.ExitStack, interrupted: list[int]) -> int:
    """`loading` holds SIGINT's remembering handler until the engine is up; `interrupted` says if one came."""
    if args.model_tag is not None:
        if args.model not in (EngineArgs.model, args.model_tag):
            raise ValueError(f"the model is given twice, as {args.model_tag!r} and --model={args.model!r}: "
                             "give one")
        args.model = args.model_tag
    if args.headless:  # a node of worker ranks only: no server, no port
        from vllm.executor.tp_engine import run_headless
        return run_headless(EngineArgs.from_cli_args(args).create_engine_config())
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port={args.port} is invalid: expected 0..65535")
    if args.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes={args.max_request_body_bytes} is invalid: expected >= 1")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len={args.max_log_len} is invalid: expected >= 0")
    if not 1 <= args.api_server_count <= MAX_API_SERVERS:
        raise ValueError(f"--api-server-count={args.api_server_count} is invalid: expected 1..{MAX_API_SERVERS} "
                         "HTTP server processes")
    if not args.chat_template_timeout > 0:
        raise ValueError(f"--chat-template-timeout={args.chat_template_timeout} is invalid: expected seconds > 0")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout={args.shutdown_timeout} is invalid: expected seconds >= 0")
    check_upstream_args({name: getattr(args, name) for name in SERVER_ARGS if getattr(args, name) is not None},
                        SERVER_ARGS)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (kimi_k2) to read the calls")
    from vllm.entrypoints.openai.chat_tools import ToolSettings
    from vllm.entrypoints.openai.tool_parsers import get_tool_parser
    from vllm.reasoning import get_reasoning_parser
    tools = ToolSettings(args.enable_auto_tool_choice,
                         get_tool_parser(args.tool_call_parser) if args.tool_call_parser else None,
                         get_reasoning_parser(args.reasoning_parser) if args.reasoning_parser else None)
    chat_template = read_chat_template(args.chat_template)
    show_hidden_metrics = show_hidden_metrics_for(args.show_hidden_metrics_for_version)
    # --max-logprobs bounds what requests may ask for (-1, the whole vocabulary, only where it allows that many);
    # the server honours it, so the engine's check of upstream flags must not call it ignored.
    max_logprobs = MAX_LOGPROBS if args.max_logprobs is None else args.max_logprobs
    if max_logprobs < -1:
        raise ValueError(f"--max-logprobs={max_logprobs} is invalid: expected -1 (no limit) or a count >= 0")
    args.max_logprobs = None
    # The port first: a port in use is reported in a second, not after the model has loaded.
    sock = bind_socket(args.host, args.port)
    # Heavy imports only once the arguments are known to be good (`vllm --help` stays fast).
    from vllm.engine.async_llm import AsyncLLM
    from vllm.entrypoints.openai.api_server import run_server
    from vllm.entrypoints.openai.serving_engine import ServerSettings

    settings = ServerSettings(served_model_names=args.served_model_name or [args.model],
                              max_log_len=args.max_log_len,
                              log_requests=logs_requests(args),
                              max_body_bytes=args.max_request_body_bytes,
                              api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                              chat_template=chat_template,
                              trust_request_chat_template=args.trust_request_chat_template,
                              chat_template_timeout_s=args.chat_template_timeout,
                              return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                              enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                              enable_force_include_usage=args.enable_force_include_usage,
                              enable_server_load_tracking=args.enable_server_load_tracking,
                              enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                              shutdown_timeout_s=args.shutdown_timeout, root_path=args.root_path,
                              access_log=not args.disable_uvicorn_access_log, docs=not args.disable_fastapi_docs,
                              tools=tools, show_hidden_metrics=show_hidden_metrics, max_logprobs=max_logprobs)
    with sock:
        if args.api_server_count > 1:
            return _run_api_servers(args, settings, sock, loading, interrupted)
        try:
            engine = AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args))
        except Exception:
            if interrupted:  # the engine core died of the same Ctrl-C (a terminal's reaches the whole group)
                raise KeyboardInterrupt from None
            raise
        loading.close()  # SIGINT's usual handling back, until the server installs its own
        if interrupted:  # a Ctrl-C some library swallowed while loading (seen on a loaded CI box): honour it now
            asyncio.run(engine.shutdown())
            raise KeyboardInterrupt
        return run_server(engine, settings, sock, args.uvicorn_log_level)


def _run_api_servers(args: argparse.Namespace, settings, sock: socket.socket, loading: contextlib.ExitStack,
                     interrupted: list[int]) -> int:
    """--api-server-count > 1: the engine core, then that many API server processes over it."""
    from vllm.entrypoints.openai.api_server_procs import APIServerLauncher
    launcher = APIServerLauncher(EngineArgs.from_cli_args(args), settings, sock, args.api_server_count,
                                 args.uvicorn_log_level)
    try:
        launcher.start_core()
    except Exception:
        if interrupted:
            raise KeyboardInterrupt from None
        raise
    loading.close()
    if interrupted:
        launcher.stop_core()
        raise KeyboardInterrupt
    return launcher.serve()


@contextlib.contextmanager
def remembered_interrupts():
    """SIGINT raises KeyboardInterrupt as usual and is also remembered (the yielded list), so that one lost in
    third-party code while loading (a bare `except:` around a probe) still stops the server once loading ends."""
    interrupted: list[int] = []

    def on_sigint(sig, frame):
        interrupted.append(sig)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


def logs_requests(args: argparse.Namespace) -> bool:
    """--enable-log-requests, unless --disable-log-requests (upstream's older spelling) says otherwise."""
    return args.enable_log_requests and not args.disable_log_requests


def show_hidden_metrics_for(version: str | None) -> bool:
    """--show-hidden-metrics-for-version: as upstream, only the previous minor version shows the hidden metrics;
    another version shows none, with a warning saying which one would."""
    if version is None:
        return False
    from vllm.version import __version__, _prev_minor_version, _prev_minor_version_was
    if _prev_minor_version_was(version):
        return True
    logging.getLogger(__name__).warning(
        "--show-hidden-metrics-for-version=%s shows nothing: this is vllm %s, whose hidden metrics were deprecated "
        "in %s (pass that to show them)", version, __version__, _prev_minor_version())
    return False


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the value itself when it is a template (as upstream)."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{" in value:
        return value
    raise ValueError(f"--chat-template={value!r} is neither a file nor a Jinja template")


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
