"""`vllm chat`: talk to a running server's /v1/chat/completions from the terminal, streamed (upstream's
subcommand and flags)."""
from __future__ import annotations

import argparse

from vllm.entrypoints.cli.openai_client import Client, add_client_args, prompts


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a running server",
                       description="Each line typed is a user message; the answer streams back. The conversation "
                                   "is kept until the end of input.")
    add_client_args(p)
    p.add_argument("--system-prompt", default=None)
    p.add_argument("-q", "--quick", default=None, metavar="MESSAGE", help="send one message, print the answer, exit")


def run(args: argparse.Namespace) -> int:
    client = Client(args)
    conversation = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    for message in prompts(args.quick):
        conversation.append({"role": "user", "content": message})
        answer = []
        for event in client.stream("/chat/completions", {"messages": conversation}):
            for choice in event["choices"]:
                piece = choice["delta"].get("content") or ""
                answer.append(piece)
                print(piece, end="", flush=True)
        print()
        conversation.append({"role": "assistant", "content": "".join(answer)})
    return 0
