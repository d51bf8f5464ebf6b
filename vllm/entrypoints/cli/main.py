"""The `vllm` console script: `vllm --version`, `vllm generate ...` (more subcommands join as they land)."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from vllm.entrypoints.cli import generate, serve
from vllm.logger import init_logging
from vllm.version import __version__

SUBCOMMANDS = {"generate": generate, "serve": serve}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm", description="A vLLM-compatible engine for Kimi-K3 / Kimi-Linear.")
    parser.add_argument("-v", "--version", action="version", version=f"vllm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    init_logging()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return SUBCOMMANDS[args.command].run(args) or 0
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while loading, before the server's own handling
        print("interrupted", file=sys.stderr)
        # Exit here, past the interpreter's shutdown: when the interrupt lands while an extension runs Python code
        # through PyRun_* (pybind11's exec/eval), CPython records it as unhandled and, at exit, kills the process
        # with SIGINT (status -2) although it was handled here. Nothing is left to clean up while loading: the
        # socket is closed, and the streams and log handlers are flushed first.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)


if __name__ == "__main__":
    sys.exit(main())
