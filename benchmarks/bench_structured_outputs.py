"""What a JSON schema costs: output tok/s of the same greedy requests with and without structured outputs.

    python benchmarks/bench_structured_outputs.py --device cuda --config benchmarks/configs/kimi-linear-1b3.json \
        --dtype bfloat16 --batch-sizes 1,64 --output-len 128 --out benchmarks/results/gpu/structured_outputs.json

The offline benchmark's random checkpoint (same --config and --seed) with the built-in tokenizer (`--config
builtin`: the built-in model itself, whose vocabulary the tokenizer covers, for CPU runs), one LLM, and
per batch size `batch` prompts of --prompt-len random ids generated to exactly --output-len tokens, once
unconstrained and once held to a JSON schema: an object whose one string field must be longer than the output
(minLength), so that no constrained request can finish early and both runs generate the same number of tokens.
The mask is then that of the inside of a JSON string, the state most of a JSON answer's tokens are sampled in.
The two runs alternate --repeats times (a warm-up each first, which also compiles the grammar); the figure is
the median tok/s of each and their ratio. Prefix caching is off, as the prompts repeat across runs.

Each timed run also records where the engine's host time went, per step: engine.step() itself, its waits for
the device (the drains' event waits), the outputs' processing (detokenization, stop checks), and with a schema
the grammar work (bitmask fills, matcher advances), so that a cost can be told apart as host work, waiting, or
device time. A random checkpoint's plain outputs are ids the built-in tokenizer decodes to nothing, while the
constrained ones are JSON text: `--no-detokenize` runs both without detokenization, so that the ratio is the
grammar's alone (the JSON check then decodes the ids afterwards).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import metadata, stats, write_json
from bench_offline_throughput import add_checkpoint_args, build_checkpoint

from vllm import LLM, SamplingParams
from vllm.assets import DEFAULT_MODEL_DIR


def schema(output_len: int) -> dict:
    return {"type": "object", "properties": {"text": {"type": "string", "minLength": 8 * output_len}},
            "required": ["text"]}


class StepTimes:
    """Wall seconds spent in the wrapped methods, and their calls, over one run."""

    def __init__(self, engine) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.engine = engine
        for owner, name in ((engine, "step"), (engine.structured, "grammar_bitmask"), (engine.structured, "advance"),
                            (engine.output_processor, "process")):
            self._wrap(owner, name)

    def _wrap(self, owner, name: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                self.calls[name] = self.calls.get(name, 0) + 1
        setattr(owner, name, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.engine._waited_total = 0.0

    def per_step_us(self) -> dict:
        steps = max(1, self.calls.get("step", 0))
        out = {"steps": self.calls.get("step", 0)}
        out.update({f"{k}_us_per_step": 1e6 * v / steps for k, v in self.seconds.items()})
        out["device_wait_us_per_step"] = 1e6 * self.engine._waited_total / steps
        return out


def count_waits(engine) -> None:
    """Sums the drains' waits for the device (LLMEngine._drain adds each to _waited, reset every step)."""
    engine._waited_total = 0.0
    drain = engine._drain

    def drained():
        before = engine._waited
        out = drain()
        engine._waited_total += engine._waited - before
        return out
    engine._drain = drained


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_args(ap)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-detokenize", action="store_true",
                    help="both runs with detokenize=False (plain random outputs decode to nothing, JSON ones do not)")
    ap.add_argument("--out", default="benchmarks/results/cpu/structured_outputs_cpu.json")
    args = ap.parse_args()
    meta = metadata(args.device)
    if args.config == "builtin":
        model = str(DEFAULT_MODEL_DIR)
        cfg = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text()).get("text_config")
    else:
        model = tempfile.mkdtemp(prefix="bench_structured_")
        hf, cfg = build_checkpoint(args, Path(model))
        del hf
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM(model=model, dtype=args.dtype, device=args.device, seed=args.seed, max_num_seqs=max(sizes),
              max_model_len=args.prompt_len + args.output_len + 8, enable_prefix_caching=False)
    gen = torch.Generator().manual_seed(args.seed)
    # Neither kind can stop early: ignore_eos holds the plain ones (which keep the fastest path, the argmax in the
    # decode graph), minLength the constrained ones.
    detok = not args.no_detokenize
    plain = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=detok)
    json_params = SamplingParams(temperature=0.0, max_tokens=args.output_len, detokenize=detok,
                                 structured_outputs={"json": schema(args.output_len)})
    tokenizer = llm.get_tokenizer()
    engine = llm.llm_engine
    count_waits(engine)
    step_times = StepTimes(engine)
    rows = []
    for batch in sizes:
        prompts = [{"prompt_token_ids": torch.randint(5, cfg["vocab_size"], (args.prompt_len,),
                                                      generator=gen).tolist()} for _ in range(batch)]
        times: dict[str, list[float]] = {"plain": [], "json": []}
        breakdown: dict[str, list[dict]] = {"plain": [], "json": []}
        tokens = {}
        for i in range(args.repeats + 1):
            for name, params in (("plain", plain), ("json", json_params)):
                if args.device == "cuda":
                    torch.cuda.synchronize()
                step_times.reset()
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                if name == "json":
                    texts = [o.outputs[0].text if detok else tokenizer.decode(o.outputs[0].token_ids) for o in outs]
                    assert all(o.outputs[0].finish_reason == "length" and t.startswith('{')
                               for o, t in zip(outs, texts)), [t[:40] for t in texts[:2]]
                tokens[name] = n
                if i:  # the first round warms up (and compiles the grammar)
                    times[name].append(n / elapsed)
                    breakdown[name].append(step_times.per_step_us())
        row = {"batch_size": batch, "tokens": tokens, **{f"{k}_tok_s": stats(v) for k, v in times.items()},
               "host_per_step": {k: v[len(v) // 2] for k, v in breakdown.items()}}
        row["json_over_plain"] = row["json_tok_s"]["median"] / row["plain_tok_s"]["median"]
        rows.append(row)
        print(f"batch {batch:>3}: plain {row['plain_tok_s']['median']:9.1f} tok/s, JSON schema "
              f"{row['json_tok_s']['median']:9.1f} tok/s: {row['json_over_plain']:.3f}x", flush=True)
        for name, b in row["host_per_step"].items():
            print(f"    {name:5}: " + ", ".join(f"{k} {v:.0f}" for k, v in b.items()), flush=True)
    path = write_json(args.out, {**meta, "benchmark": "structured_outputs",
                                 "config": {**vars(args), "model_config": cfg}, "results": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
