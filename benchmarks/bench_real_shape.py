"""Decode and time to first token at a real model's shape (Kimi-Linear-48B-A3B by default) with dummy weights,
against the decode step's bytes floor, in one run.

    python benchmarks/bench_real_shape.py --config benchmarks/configs/kimi-linear-48b-a3b.json \
        --batch-sizes 1,16,64,256 --ttft-lens 2048,8192,32768 --out benchmarks/results/gpu/<date>_<card>_48b.json

The model directory is config.json plus the built-in tokenizer (`--load-format dummy`: random weights shaped as a
trained model's, so the router spreads tokens over the experts; no checkpoint on disk). Transformers is not run
here: the 48B model fills the card on its own (benchmarks/bench_offline_throughput.py with the reduced-layer
copy, kimi-linear-48b-a3b-8l.json, compares the two on the same weights).

Decode step time at batch B: (t(O tokens) - t(1 token)) / (O - 1), both medians of `--repeats` calls of
`LLM.generate` over B prompts of `--prompt-len` random ids (greedy, ignore_eos): the prefill and the engine's
per-call costs cancel, what is left is the steady decode step with the engine's defaults (CUDA graphs, async
scheduling). Its bytes floor, against the copy bandwidth measured in the same run:
- every weight but the routed experts and the embedding table (B rows of that), read once;
- the routed experts a step touches: E (1 - (1 - k/E)^B) of each MoE layer's E under uniform routing (the dummy
  router spreads tokens so; the JSON keeps the count);
- each request's KDA state read and written (and its conv window), and its MLA latent cache read at the
  step's mean context.
TTFT: one request of each length, max_tokens=1, the engine's default chunking.
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from bench_common import metadata, stats, sync, write_json  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "kernels"))
from timing import copy_bandwidth_gbps  # noqa: E402

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.assets import DEFAULT_MODEL_DIR  # noqa: E402
from vllm.attention.selector import reference_backends  # noqa: E402
from vllm.model_executor.model_loader import build_model  # noqa: E402
from vllm.tools.make_tiny_model import TOKENIZER_FILES  # noqa: E402
from vllm.transformers_utils.configs.kimi_k3 import KimiK3TextConfig  # noqa: E402


def model_dir(config: Path) -> Path:
    d = Path(tempfile.mkdtemp(prefix="bench_real_shape_"))
    shutil.copy(config, d / "config.json")
    for f in TOKENIZER_FILES:
        if (DEFAULT_MODEL_DIR / f).is_file():
            shutil.copy(DEFAULT_MODEL_DIR / f, d / f)
    return d


def weight_bytes(cfg: KimiK3TextConfig, dtype: torch.dtype) -> dict:
    """Bytes of the routed experts, of everything else, and of one embedding row, from the model built on the
    meta device (no memory)."""
    params = dict(build_model(cfg, dtype, "meta", reference_backends()).named_parameters())
    embed = params["model.embed_tokens.weight"]
    expert = sum(p.numel() * p.element_size() for n, p in params.items() if ".experts." in n)
    rest = sum(p.numel() * p.element_size() for n, p in params.items() if ".experts." not in n)
    return {"experts": expert, "dense": rest - embed.numel() * embed.element_size(),
            "embedding_row": embed.shape[1] * embed.element_size()}


def floor_bytes(cfg: KimiK3TextConfig, weights: dict, batch: int, context: float, state_bytes: int) -> dict:
    """The decode step's bytes floor at `batch` requests of mean `context` tokens, by part; `weights` from
    weight_bytes."""
    dense = weights["dense"] + batch * weights["embedding_row"]
    expert = weights["experts"]
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    E, k = cfg.num_experts, cfg.num_experts_per_token
    touched = E * (1 - (1 - k / E) ** batch)
    experts = expert / max(moe_layers, 1) / E * touched * moe_layers
    kda = len(cfg.kda_layers) * batch * (2 * cfg.kda_num_heads * cfg.kda_head_dim ** 2 * state_bytes
                                          + 2 * 3 * cfg.kda_proj_dim * (cfg.conv_kernel_size - 1) * 2)
    mla = len(cfg.mla_layers) * batch * (context + 1) * cfg.mla_cache_dim * 2
    return {"dense_weights": dense, "experts": experts, "experts_touched_per_layer": touched, "kda_state": kda,
            "mla_cache": mla, "total": dense + experts + kda + mla}


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        sync("cuda")
        t0 = time.perf_counter()
        fn()
        sync("cuda")
        out.append(time.perf_counter() - t0)
    return out


def plot(rows: list[dict], ttft: list[dict], meta: dict, title: str, png: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    xs = list(range(len(rows)))
    ax.bar([x - 0.2 for x in xs], [r["step_ms"] for r in rows], 0.4, label="decode step (measured)")
    ax.bar([x + 0.2 for x in xs], [r["floor_ms"] for r in rows], 0.4, label="bytes floor")
    for x, r in zip(xs, rows):
        ax.annotate(f"{r['pct_floor']:.0f}% of floor\n{r['tokens_per_s']:,.0f} tok/s", (x, r["step_ms"]),
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(xs, [f"batch {r['batch_size']}" for r in rows])
    ax.set(ylabel="ms per decode step (median)", title=title)
    ax.margins(y=0.2)
    ax.legend(fontsize=8)
    if ttft:
        ax = axes[1]
        ax.plot([r["prompt_len"] for r in ttft], [r["ms"]["median"] for r in ttft], marker="o")
        for r in ttft:
            ax.annotate(f"{r['ms']['median']:.0f} ms", (r["prompt_len"], r["ms"]["median"]), fontsize=7)
        ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="ms (median)", title="time to first token")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{meta['device_name']}, commit {meta['git_commit'][:12]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="benchmarks/configs/kimi-linear-48b-a3b.json")
    ap.add_argument("--batch-sizes", default="1,16,64,256")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=65, help="O: the step time is over the last O - 1 tokens")
    ap.add_argument("--ttft-lens", default="2048,8192,32768")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--mamba-ssm-cache-dtype", default="float32")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--out", default="benchmarks/results/gpu/real_shape_48b.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    meta = metadata("cuda")
    bw = copy_bandwidth_gbps()
    print(f"copy bandwidth {bw:.0f} GB/s (measured in this run)", flush=True)
    cfg = KimiK3TextConfig.from_dict(json.loads(Path(args.config).read_text()))
    batches = [int(b) for b in args.batch_sizes.split(",")]
    ttft_lens = [int(n) for n in args.ttft_lens.split(",") if n]
    P, O = args.prompt_len, args.output_len  # noqa: E741
    d = model_dir(Path(args.config))
    t0 = time.perf_counter()
    llm = LLM(model=str(d), load_format="dummy", dtype=args.dtype, max_num_seqs=max(batches),
              max_model_len=max([P + O, *[n + 8 for n in ttft_lens]]), enable_prefix_caching=False,
              mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype, gpu_memory_utilization=args.gpu_memory_utilization)
    startup_s = time.perf_counter() - t0
    print(f"start-up {startup_s:.1f} s", flush=True)
    state_bytes = torch.empty(0, dtype=getattr(torch, args.mamba_ssm_cache_dtype)).element_size()
    weights = weight_bytes(cfg, getattr(torch, args.dtype))
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in batches:
        reqs = [{"prompt_token_ids": p} for p in torch.randint(3, cfg.vocab_size, (b, P), generator=gen).tolist()]
        full = SamplingParams(temperature=0.0, max_tokens=O, ignore_eos=True)
        first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        t_full = timed(lambda reqs=reqs: llm.generate(reqs, full, use_tqdm=False), args.repeats)
        t_first = timed(lambda reqs=reqs: llm.generate(reqs, first, use_tqdm=False), args.repeats)
        step_s = (stats(t_full)["median"] - stats(t_first)["median"]) / (O - 1)
        floor = floor_bytes(cfg, weights, b, P + O / 2, state_bytes)
        floor_s = floor["total"] / (bw * 1e9)
        row = {"batch_size": b, "prompt_len": P, "output_len": O, "step_ms": step_s * 1e3,
               "tokens_per_s": b / step_s, "floor_ms": floor_s * 1e3, "pct_floor": 100 * floor_s / step_s,
               "floor_bytes": floor, "generate_s": stats(t_full), "first_token_s": stats(t_first)}
        rows.append(row)
        print(f"batch {b:>4}: step {row['step_ms']:7.2f} ms  {row['tokens_per_s']:9.1f} tok/s  floor "
              f"{row['floor_ms']:6.2f} ms ({row['pct_floor']:.0f}%)", flush=True)
    ttft = []
    one = SamplingParams(temperature=0.0, max_tokens=1)
    for n in ttft_lens:
        req = [{"prompt_token_ids": torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist()}]
        t = timed(lambda req=req: llm.generate(req, one, use_tqdm=False), args.repeats)
        ttft.append({"prompt_len": n, "ms": stats([x * 1e3 for x in t])})
        print(f"TTFT {n:>6}: {ttft[-1]['ms']['median']:8.1f} ms", flush=True)
    data = {**meta, "benchmark": "real_shape", "config": vars(args), "model_config": json.loads(
        Path(args.config).read_text()), "copy_bw_gbps": bw, "startup_s": startup_s, "decode": rows, "ttft": ttft}
    path = write_json(args.out, data)
    plot(rows, ttft, meta, f"{Path(args.config).stem}, dummy weights, {args.dtype}, prompt {P}",
         path.with_suffix(".png"))
    shutil.rmtree(d, ignore_errors=True)
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
