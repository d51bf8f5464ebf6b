"""`vllm generate`: greedy offline generation for a few prompts (the built-in tiny model by default)."""
from __future__ import annotations

import argparse
import time

import torch

from vllm.assets import DEFAULT_MODEL_DIR
from vllm.model_executor.model_loader import load_model
from vllm.model_executor.sequence_runner import SequenceRunner
from vllm.transformers_utils.tokenizer import get_tokenizer

DEFAULT_PROMPTS = ["The capital of France is", "Q: What is two plus two?\nA:", "Once upon a time"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text offline for a few prompts",
                       description="Greedy generation for a batch of prompts, printed to stdout.")
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR),
                   help="model directory (config.json + safetensors + tokenizer); default: the built-in tiny model")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for several); default: three examples")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")


def run(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    tokenizer = get_tokenizer(args.model)
    model = load_model(args.model, args.dtype, device)
    prompts = args.prompt or DEFAULT_PROMPTS
    ids = [tokenizer.encode(p) for p in prompts]
    if any(not x for x in ids):
        raise ValueError("empty prompt: every --prompt needs at least one token")
    runner = SequenceRunner(model, max_seqs=len(ids), max_model_len=max(map(len, ids)) + args.max_tokens)
    start = time.perf_counter()
    outs = runner.generate_greedy(ids, args.max_tokens, stop_ids=tuple(model.config.eos_token_ids))
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outs):
        print(f"Prompt: {prompt!r}\nGenerated: {tokenizer.decode(out, skip_special_tokens=True)!r}\n")
    n = sum(map(len, outs))
    print(f"{n} tokens in {elapsed:.2f} s ({n / elapsed:.1f} tok/s) on {device}")
    return 0
