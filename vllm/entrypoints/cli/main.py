"""The `vllm` console script: `vllm --version`, and the subcommands serve, generate, chat, complete, run-batch,
bench, collect-env."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from vllm.entrypoints.cli import bench, chat, collect_env, complete, generate, run_batch, serve
from vllm.logger import init_logging
from vllm.version import __version__

SUBCOMMANDS = {"generate": generate, "serve": serve, "chat": chat, "complete": complete, "run-batch": run_batch,
               "collect-env": collect_env, "bench": bench}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm", description="A vLLM-compatible engine for Kimi-K3 / Kimi-Linear.")
    parser.add_argument("-v", "--version", action="version", version=f"vllm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        module.add_parser(sub)
    return parser


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of every subcommand."""
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {s for p in subs.choices.values() for s in p._option_string_actions}


def expand_config_file(argv: list[str], known: set[str]) -> list[str]:
    """`--config FILE.yaml` as upstream: the file's keys are flag names (`max-model-len: 512`, `model: DIR`),
    put before the command line's other arguments, so that the command line wins where both give a flag."""
    if "--config" not in argv and not any(a.startswith("--config=") for a in argv):
        return argv
    i = next(i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config="))
    path = argv[i].partition("=")[2] if "=" in argv[i] else (argv[i + 1] if i + 1 < len(argv) else None)
    rest = argv[:i] + argv[i + (1 if "=" in argv[i] else 2):]
    if path is None:
        raise ValueError("--config needs a YAML file")
    import yaml
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: cannot read it as YAML ({e})") from None
    except RecursionError:
        raise ValueError(f"--config {path}: lists or mappings nested too deeply to read") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    flags = []
    for key, value in loaded.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:  # a --no- form where the flag has one; else false is the flag's default
            flags += ["--no-" + flag[2:]] if "--no-" + flag[2:] in known else []
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    command = 1 if rest and not rest[0].startswith("-") else 0  # after the subcommand's name
    return rest[:command] + flags + rest[command:]


def main(argv: list[str] | None = None) -> int:
    init_logging()
    parser = build_parser()
    try:
        argv = expand_config_file(list(sys.argv[1:] if argv is None else argv), option_strings(parser))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
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
