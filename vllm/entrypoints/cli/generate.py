"""`vllm generate`: offline generation for a few prompts through `LLM` (the built-in tiny model by default)."""
from __future__ import annotations

import argparse
import time

from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.llm import LLM
from vllm.sampling_params import SamplingParams

# The built-in model was trained on Python's standard library, so its default prompts are code.
DEFAULT_PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef ", "class Stack:\n    def __init__(self):\n"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text offline for a few prompts",
                       description="Offline generation for a batch of prompts through LLM, printed to stdout.")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for several); default: three examples")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    EngineArgs.add_cli_args(p)


def run(args: argparse.Namespace) -> int:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    prompts = args.prompt or DEFAULT_PROMPTS
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for out in outputs:
        print(f"Prompt: {out.prompt!r}\nGenerated: {out.outputs[0].text!r}\n")
    n = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{n} tokens in {elapsed:.2f} s ({n / elapsed:.1f} tok/s) on {llm.llm_engine.config.model_config.device}")
    return 0
