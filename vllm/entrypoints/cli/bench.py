"""`vllm bench serve | throughput | latency`: upstream's benchmark subcommands, with its flag and result names.

- serve: a load of streaming /v1/completions requests against a running server (vllm/benchmarks/serve.py).
- throughput: offline generation of --num-prompts random prompts through LLM: requests and tokens per second.
- latency: one batch of --batch-size random prompts generated --num-iters times: seconds per batch.
Random prompts are token ids in [5, vocab size).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import numpy as np

from vllm.engine.arg_utils import EngineArgs


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark serving, offline throughput or latency",
                       description=__doc__.split("\n\n")[0])
    kinds = p.add_subparsers(dest="bench_command", metavar="{serve,throughput,latency}", required=True)
    serve = kinds.add_parser("serve", help="load a running server")
    serve.add_argument("--backend", default="vllm", choices=["vllm", "openai"], help="both: /v1/completions")
    serve.add_argument("--base-url", default=None, help="the server (default: http://HOST:PORT)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions"])
    serve.add_argument("--model", default=None, help="served model name (default: the server's first)")
    serve.add_argument("--tokenizer", default=None, help="a local tokenizer: random prompt ids stay in its vocab")
    serve.add_argument("--trust-remote-code", action="store_true", help="that tokenizer may run its own code")
    serve.add_argument("--dataset-name", default="random", choices=["random"])
    serve.add_argument("--random-input-len", type=int, default=1024)
    serve.add_argument("--random-output-len", type=int, default=128)
    serve.add_argument("--random-range-ratio", type=float, default=0.0)
    serve.add_argument("--num-prompts", type=int, default=1000)
    serve.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second")
    serve.add_argument("--max-concurrency", type=int, default=None)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--ignore-eos", action="store_true")
    serve.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    serve.add_argument("--metric-percentiles", default="99")
    serve.add_argument("--save-result", action="store_true")
    serve.add_argument("--result-dir", default=".")
    serve.add_argument("--result-filename", default=None)
    serve.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole run")
    serve.add_argument("--client-processes", type=int, default=None,
                       help="client processes the requests are spread over (default: a quarter of the cores, 1-4)")
    for name, helptext in (("throughput", "offline requests and tokens per second"),
                           ("latency", "offline seconds per batch")):
        q = kinds.add_parser(name, help=helptext)
        q.add_argument("--input-len", type=int, default=1024 if name == "throughput" else 32)
        q.add_argument("--output-len", type=int, default=128)
        q.add_argument("--output-json", default=None, help="write the results here")
        if name == "throughput":
            q.add_argument("--num-prompts", type=int, default=1000)
        else:
            q.add_argument("--batch-size", type=int, default=8)
            q.add_argument("--num-iters-warmup", type=int, default=10)
            q.add_argument("--num-iters", type=int, default=30)
        EngineArgs.add_cli_args(q)


def run(args: argparse.Namespace) -> int:
    result = {"serve": bench_serve, "throughput": bench_throughput, "latency": bench_latency}[args.bench_command](args)
    path = getattr(args, "output_json", None)
    if args.bench_command == "serve" and args.save_result:
        name = args.result_filename or f"vllm-{args.request_rate}qps-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path = str(Path(args.result_dir) / name)
    if path:
        Path(path).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


def _vocab_size(tokenizer_dir: str | None, trust_remote_code: bool) -> int:
    if tokenizer_dir and Path(tokenizer_dir).is_dir():
        from vllm.transformers_utils.tokenizer import get_tokenizer
        return len(get_tokenizer(tokenizer_dir, trust_remote_code=trust_remote_code))
    return 500  # below every real vocabulary


def bench_serve(args: argparse.Namespace) -> dict:
    from vllm.benchmarks.serve import default_client_processes, make_prompts, run_load_processes, serving_metrics
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    processes = default_client_processes() if args.client_processes is None else args.client_processes
    if processes < 1:
        raise SystemExit(f"--client-processes={processes} is invalid: expected an integer >= 1")
    prompts = make_prompts(args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio,
                           _vocab_size(args.tokenizer or args.model, args.trust_remote_code), random.Random(args.seed))
    recs, duration, model, client = run_load_processes(
        base, args.endpoint, args.model, prompts, args.request_rate, args.max_concurrency or 0, args.seed,
        args.timeout, ignore_eos=args.ignore_eos, num_processes=processes)
    percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
    result = {"backend": args.backend, "model_id": model, "num_prompts": args.num_prompts,
              "request_rate": str(args.request_rate), "max_concurrency": args.max_concurrency,
              **serving_metrics(recs, duration, percentiles), "client": client}
    print(f"{' Serving Benchmark Result ':=^50}")
    for key, label in (("completed", "Successful requests"), ("failed", "Failed requests"),
                       ("duration", "Benchmark duration (s)"), ("total_input_tokens", "Total input tokens"),
                       ("total_output_tokens", "Total generated tokens"),
                       ("request_throughput", "Request throughput (req/s)"),
                       ("output_throughput", "Output token throughput (tok/s)"),
                       ("total_token_throughput", "Total Token throughput (tok/s)")):
        print(f"{label + ':':<40}{result[key]:<10.2f}" if isinstance(result[key], float) else
              f"{label + ':':<40}{result[key]:<10}")
    for metric in args.percentile_metrics.split(","):
        for stat in ("mean", "median", *(f"p{p:g}" for p in percentiles)):
            value = result.get(f"{stat}_{metric}_ms")
            print(f"{f'{stat.capitalize()} {metric.upper()} (ms):':<40}{'-' if value is None else f'{value:.2f}'}")
    print(f"{'Client processes / CPU s / busiest:':<40}{client['processes']} / {client['cpu_s']:.2f} / "
          f"{100 * client['max_process_cpu_util']:.0f}% of a core")
    print("=" * 50)
    return result


def _random_prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(5, vocab) for _ in range(length)]} for _ in range(n)]


def _llm(args: argparse.Namespace):
    from vllm.entrypoints.llm import LLM
    return LLM(**vars(EngineArgs.from_cli_args(args)))


def bench_throughput(args: argparse.Namespace) -> dict:
    from vllm.sampling_params import SamplingParams
    llm = _llm(args)
    prompts = _random_prompts(args.num_prompts, args.input_len, len(llm.get_tokenizer()), args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    total = output_tokens + args.num_prompts * args.input_len
    result = {"elapsed_time": elapsed, "num_requests": len(outs), "total_num_tokens": total,
              "requests_per_second": len(outs) / elapsed, "tokens_per_second": total / elapsed,
              "output_tokens_per_second": output_tokens / elapsed}
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.2f} total "
          f"tokens/s, {result['output_tokens_per_second']:.2f} output tokens/s")
    return result


def bench_latency(args: argparse.Namespace) -> dict:
    from vllm.sampling_params import SamplingParams
    llm = _llm(args)
    prompts = _random_prompts(args.batch_size, args.input_len, len(llm.get_tokenizer()), args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def once() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start
    for _ in range(args.num_iters_warmup):
        once()
    latencies = [once() for _ in range(args.num_iters)]
    percentiles = [10, 25, 50, 75, 90, 99]
    result = {"avg_latency": float(np.mean(latencies)), "latencies": latencies,
              "percentiles": {str(p): float(np.percentile(latencies, p)) for p in percentiles}}
    print(f"Avg latency: {result['avg_latency']} seconds")
    for p, v in result["percentiles"].items():
        print(f"{p}% percentile latency: {v} seconds")
    return result
