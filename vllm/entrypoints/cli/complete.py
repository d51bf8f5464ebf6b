"""`vllm complete`: text completions from a running server's /v1/completions, streamed (upstream's subcommand
and flags)."""
from __future__ import annotations

import argparse

from vllm.entrypoints.cli.openai_client import Client, add_client_args, prompts


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("complete", help="complete prompts with a running server",
                       description="Each line typed is a prompt; its completion streams back.")
    add_client_args(p)
    p.add_argument("-q", "--quick", default=None, metavar="PROMPT", help="complete one prompt, print it, exit")


def run(args: argparse.Namespace) -> int:
    client = Client(args)
    for prompt in prompts(args.quick):
        for event in client.stream("/completions", {"prompt": prompt}):
            for choice in event["choices"]:
                print(choice["text"], end="", flush=True)
        print()
    return 0
