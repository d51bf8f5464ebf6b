"""Offline generation throughput and time to first token: our `LLM.generate` (with its defaults, and eagerly)
versus transformers' `KimiLinearForCausalLM`, in one run.

    python benchmarks/bench_offline_throughput.py --device cpu --out benchmarks/results/cpu/offline_throughput_cpu.json
    python benchmarks/bench_offline_throughput.py --device cuda --config benchmarks/configs/kimi-linear-1b3.json \
        --dtype bfloat16 --batch-sizes 1,16,64,256 --prompt-len 256 --output-len 128 --engines ours,ours_eager,hf \
        --ttft-lens 256,2048,8192,32768 --out benchmarks/results/gpu/offline_throughput_cuda.json

Both run the SAME weights: a random transformers model (`--config tiny`, or a KimiLinearConfig JSON) is written
with save_pretrained (plus the built-in tokenizer files) and our engine loads that directory. A batch of B is B
prompts of `--prompt-len` random token ids, greedy, exactly `--output-len` new tokens (ignore_eos for us,
eos_token_id=None for transformers). One warm-up each, then `--repeats` timed runs alternating between the two
engines; tokens/s counts output tokens over the whole call (prefill included), from the median time. On CPU
transformers runs its plain torch KDA (the tests/hf_oracle.py import trick); on CUDA it uses what it picks
(fla-core kernels if importable), recorded in the JSON. `--engines` picks among `ours` (the engine's defaults:
CUDA graphs and async scheduling on CUDA), `ours_sync` (defaults but --no-async-scheduling), `ours_eager`
(--enforce-eager) and `hf`. `--ttft-lens`: one request of each length with
max_tokens=1 through our engine (its default token budget, so long prompts run in chunks; `ours` and, when
listed, `ours_eager`) against transformers' forward on the same prompt (no cache, logits for the last token
only), medians of --repeats.
Writes JSON (raw per-repeat times) and a bar-chart PNG.
"""
from __future__ import annotations

import argparse
import importlib.util
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
import matplotlib.pyplot as plt
from bench_common import REPO, metadata, set_threads, stats, sync, write_json

from vllm import LLM, SamplingParams
from vllm.assets import DEFAULT_MODEL_DIR, TINY_TOKENIZER_DIR

TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None,
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "num_local_experts": 8,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
        "routed_scaling_factor": 1.0, "hidden_act": "silu", "rms_norm_eps": 1e-5, "bos_token_id": 1,
        "eos_token_id": 2, "pad_token_id": 0,
        "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "head_dim": 16, "num_heads": 4,
                               "short_conv_kernel_size": 4}}


def hf_classes(device: str):
    if device == "cpu":  # fla's Triton kernels are CUDA-only: hide them, as the tests' oracle does
        sys.path.insert(0, str(REPO / "tests"))
        from hf_oracle import import_torch_only_oracle
        return import_torch_only_oracle()
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    return KimiLinearConfig, KimiLinearForCausalLM


def add_checkpoint_args(ap: argparse.ArgumentParser) -> None:
    """The flags build_checkpoint reads (every benchmark built on its checkpoint takes them alike)."""
    ap.add_argument("--config", default="tiny", help="'tiny' or a KimiLinearConfig JSON file")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--seed", type=int, default=0)


def build_checkpoint(args, out_dir: Path):
    """A random transformers model, saved where our engine can load it; returns the (kept) HF model."""
    config_cls, model_cls = hf_classes(args.device)
    cfg = dict(TINY) if args.config == "tiny" else json.loads(Path(args.config).read_text())
    torch.manual_seed(args.seed)
    # Built in the benchmark's dtype: a 48B-wide model built in float32 first would need twice its bytes.
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, args.dtype))
    try:
        with torch.device(args.device):
            model = model_cls(config_cls(**cfg)).to(getattr(torch, args.dtype)).eval()
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(out_dir)
    saved = json.loads((out_dir / "config.json").read_text())
    saved["mla_latent_norm_eps"] = 1e-6  # transformers hard-codes 1e-6 in q_a/kv_a_layernorm (tests/hf_oracle.py)
    (out_dir / "config.json").write_text(json.dumps(saved, indent=1))
    # The tiny config's 512-token vocabulary takes the tiny tokenizer: the built-in one's ids would not fit.
    tokenizer_dir = TINY_TOKENIZER_DIR if args.config == "tiny" else DEFAULT_MODEL_DIR
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / f).is_file():
            shutil.copy(tokenizer_dir / f, out_dir / f)
    return model, cfg


def time_interleaved(fns: dict, repeats: int, device: str) -> tuple[dict, dict]:
    """One warm-up each, then the engines alternate run by run, so drifting machine load hits both alike."""
    outs = {k: fn() for k, fn in fns.items()}
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            outs[k] = fn()
            sync(device)
            times[k].append(time.perf_counter() - t0)
    return times, outs


def plot(rows: list[dict], ttft: list[dict], engines: list[str], meta: dict, title: str, png: str) -> None:
    panels = 2 if ttft else 1
    fig, axes = plt.subplots(1, panels, figsize=(8 * panels, 4.8), squeeze=False)
    ax = axes[0][0]
    width = 0.8 / len(engines)
    for j, key in enumerate(engines):
        vals = [r[key]["tokens_per_s"] for r in rows]
        bars = ax.bar([i + (j - (len(engines) - 1) / 2) * width for i in range(len(rows))], vals, width=width,
                      label=LABELS[key])
        ax.bar_label(bars, [f"{v:,.0f}" for v in vals], fontsize=7)
    ax.set_xticks(list(range(len(rows))), [f"batch {r['batch_size']}" for r in rows])
    ax.set(yscale="log", ylabel="output tokens/s (median)", title=title)
    ax.margins(y=0.25)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    if ttft:
        ax = axes[0][1]
        lens = [r["prompt_len"] for r in ttft]
        for key, label in (("ours", "ours: TTFT (generate, max_tokens=1)"), ("ours_eager", "ours, eager: TTFT"),
                           ("hf", "transformers forward")):
            if key in ttft[0]:
                ax.plot(lens, [r[key]["ms"]["median"] for r in ttft], marker="o", label=label)
        ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="ms (median)", title="time to first token")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{meta['device_name']} ({meta['device']}), commit {meta['git_commit'][:12]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


LABELS = {"ours": "ours: LLM.generate (defaults)", "ours_sync": "ours: --no-async-scheduling",
          "ours_eager": "ours: --enforce-eager",
          "hf": "transformers generate"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_args(ap)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--engines", default="ours,hf", help="comma list of ours, ours_sync, ours_eager, hf")
    ap.add_argument("--ttft-lens", default="", help="prompt lengths for time to first token (empty: none)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per batch size and engine (after 1 warm-up)")
    ap.add_argument("--kv-cache-gib", type=float, default=4.0, help="each engine's cache budget (they coexist)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--out", default="benchmarks/results/cpu/offline_throughput_cpu.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")  # start-up lines
    set_threads(args.threads)
    meta = metadata(args.device)  # at the start: the commit that was measured, not whatever landed meanwhile
    engines = args.engines.split(",")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    ttft_lens = [int(n) for n in args.ttft_lens.split(",") if n]
    P, O = args.prompt_len, args.output_len
    tmp = Path(tempfile.mkdtemp(prefix="bench_offline_"))
    hf, cfg = build_checkpoint(args, tmp)
    found = {m: importlib.util.find_spec(m) is not None for m in ("fla", "causal_conv1d")}
    hf_info = {"attn_implementation": hf.config._attn_implementation,
               "kda": "torch (fla hidden)" if args.device == "cpu" else
               ("fla-core" if found["fla"] else "torch (fla not installed)"),
               "conv": "causal_conv1d" if found["causal_conv1d"] else "torch (causal_conv1d not installed)"}
    gen = torch.Generator().manual_seed(args.seed)
    prompts = {b: torch.randint(3, cfg["vocab_size"], (b, P), generator=gen) for b in batches}
    kv_bytes = int(args.kv_cache_gib * (1 << 30))

    decode_kw = dict(max_model_len=P + O, max_num_seqs=max(batches),
                     max_num_batched_tokens=max(2048, max(batches) * P))
    llms, startup_s = {}, {}
    for k in engines:
        if k != "hf":  # start-up (load, profile, graph capture) timed per engine
            t0 = time.perf_counter()
            llms[k] = LLM(model=str(tmp), dtype=args.dtype, device=args.device, seed=args.seed,
                          kv_cache_memory_bytes=kv_bytes, enforce_eager=k == "ours_eager",
                          async_scheduling=False if k == "ours_sync" else None, enable_prefix_caching=False,
                          **decode_kw)
            startup_s[k] = time.perf_counter() - t0
            print(f"{k}: start-up {startup_s[k]:.1f} s", flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=O, ignore_eos=True)

    @torch.inference_mode()
    def hf_generate(ids: torch.Tensor) -> torch.Tensor:
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=O, min_new_tokens=O,
                           do_sample=False, eos_token_id=None, pad_token_id=0)

    raw, rows = {k: {} for k in engines}, []
    for b in batches:
        ids, reqs = prompts[b].to(args.device), [{"prompt_token_ids": p} for p in prompts[b].tolist()]
        fns = {k: (lambda ids=ids: hf_generate(ids)) if k == "hf" else
               (lambda reqs=reqs, k=k: llms[k].generate(reqs, params, use_tqdm=False)) for k in engines}
        times, outs = time_interleaved(fns, args.repeats, args.device)
        row = {"batch_size": b}
        for k in engines:
            raw[k][str(b)] = times[k]
            row[k] = {"s": stats(times[k]), "tokens_per_s": b * O / stats(times[k])["median"]}
            if k != "hf":
                assert all(len(o.outputs[0].token_ids) == O for o in outs[k])
        if "hf" in engines:
            assert outs["hf"].shape == (b, P + O), f"transformers made {tuple(outs['hf'].shape)}, expected {(b, P + O)}"
            for k in llms:
                same = sum(list(o.outputs[0].token_ids) == h for o, h in zip(outs[k], outs["hf"][:, P:].tolist()))
                row[f"{k}_greedy_sequences_identical_to_hf"] = f"{same}/{b}"
        rows.append(row)
        print(f"batch {b:>4}: " + "  ".join(f"{k} {row[k]['tokens_per_s']:>9.1f} tok/s" for k in engines), flush=True)
    llms.clear()
    torch.cuda.empty_cache() if args.device == "cuda" else None
    ttft_rows = []
    if ttft_lens:
        # `ours` with the engine's defaults (prompt chunks of up to 512 tokens replay piecewise graphs on CUDA);
        # `ours_eager` too when it is benchmarked, which is how a prompt ran before piecewise graphs.
        ttft_engines = [k for k in ("ours", "ours_eager") if k in engines] or ["ours"]
        ttft_llms = {k: LLM(model=str(tmp), dtype=args.dtype, device=args.device, seed=args.seed,
                            kv_cache_memory_bytes=kv_bytes, max_model_len=max(ttft_lens) + 8, max_num_seqs=8,
                            enforce_eager=k == "ours_eager", enable_prefix_caching=False) for k in ttft_engines}
        one = SamplingParams(temperature=0.0, max_tokens=1)
        for n in ttft_lens:
            ids = torch.randint(3, cfg["vocab_size"], (1, n), generator=gen)
            req = [{"prompt_token_ids": ids[0].tolist()}]

            @torch.inference_mode()
            def hf_forward(ids=ids.to(args.device)):
                return hf(ids, logits_to_keep=1).logits
            fns = {k: (lambda req=req, llm=llm: llm.generate(req, one, use_tqdm=False))
                   for k, llm in ttft_llms.items()}
            times, _ = time_interleaved({**fns, "hf": hf_forward}, args.repeats, args.device)
            row = {"prompt_len": n, **{k: {"ms": stats([t * 1e3 for t in v])} for k, v in times.items()}}
            row["ratio_ours_over_hf"] = row["ours"]["ms"]["median"] / row["hf"]["ms"]["median"] \
                if "ours" in row else None
            ttft_rows.append(row)
            print(f"TTFT {n:>6} tokens: " + "  ".join(f"{k} {row[k]['ms']['median']:8.1f} ms" for k in fns)
                  + f"  transformers {row['hf']['ms']['median']:8.1f} ms", flush=True)
        del ttft_llms
    shutil.rmtree(tmp, ignore_errors=True)
    import transformers
    data = {**meta, "benchmark": "offline_throughput", "config": {**vars(args), "model_config": cfg},
            "transformers": {"version": transformers.__version__, **hf_info}, "startup_s": startup_s,
            "results": rows, "ttft": ttft_rows, "raw_s": raw}
    path = write_json(args.out, data)
    name = "tiny Kimi-Linear" if args.config == "tiny" else Path(args.config).stem
    plot(rows, ttft_rows, engines, meta, f"{name}, {args.dtype}, prompt {P}, output {O}, greedy",
         str(path.with_suffix(".png")))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
