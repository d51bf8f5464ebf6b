"""The fused MoE (layers/fused_moe) against the paths it replaced and torch's grouped GEMM, 1..8192 tokens.

Peers, measured in the same run on the same weights and routing:
- `every_expert`: the old graph path, every expert on every token (three batched matmuls over stacked weights);
  skipped where its [E, T, 2I] intermediate would pass 4 GiB;
- `torch_loop`: the old eager path, one expert at a time with a host sync for the group sizes (timed eagerly:
  it cannot be captured);
- `grouped_mm`: tokens sorted by expert with torch ops, then `torch._grouped_mm` (cuBLAS/CUTLASS grouped GEMM)
  for gate/up and down.

Decode-sized rows report bandwidth over the bytes the chosen experts' weights take (each chosen expert read
once), against the better of the run's copy bandwidth and the shared reference (and against the HBM3e peak,
4.8 TB/s: a read-only stream can beat a copy's read + write mix); prefill-sized rows report
TFLOP/s against the H200's bf16 dense peak (989 TFLOP/s) and against cuBLAS's bf16 GEMM measured in this run.

    python benchmarks/kernels/bench_fused_moe.py --out benchmarks/results/gpu/fused_moe.json [--sweep]
    python benchmarks/kernels/bench_fused_moe.py --dtype float32 --shapes builtin --tokens 16,32,64,128,256,320 \
        --sweep --sweep-shapes builtin --sweep-tokens 32,320 --out benchmarks/results/gpu/fused_moe_builtin.json

TFLOP/s figures are against bf16 peaks whatever `--dtype` is (float32 runs on the FMA units, far below them).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import write_json  # noqa: E402
from timing import bandwidth_report, matmul_peak_tflops, roofline_us, time_graph  # noqa: E402

from vllm.model_executor.layers.fused_moe import MoEActivation, fused_experts  # noqa: E402
from vllm.model_executor.layers.fused_moe.fused_moe import GemmConfig, pick_config, smem_per_block  # noqa: E402
from vllm.model_executor.layers.fused_moe.tile_configs import tuned_config  # noqa: E402
from vllm.utils import num_sms  # noqa: E402

H200_BF16_DENSE_TFLOPS = 989.0
# A copy both reads and writes; a MoE's weight stream only reads, and reads alone run faster than a copy's r+w
# mix, so decode rows can pass 100% of copy bandwidth. The HBM3e peak bounds them physically.
H200_HBM_GBPS = 4800.0
# (name, experts, top-k, hidden the experts read, expert intermediate). K3's experts read its latent width
# (routed_expert_hidden_size 3584) with moe_intermediate_size 3072 and top-16 of 896; 256 of them fit here and
# the per-expert bytes and FLOPs are K3's.
# The built-in model's experts (8, top-2, latent width 128, intermediate 128) run in float32 (`--dtype float32`):
# its verify steps of 64 requests x 5 tokens (640 pairs) take the prefill tiles, where they ran ~2.6x slower per
# step than 256 tokens did (docs/spec_decode.md).
SHAPES = {"kimi-linear-1b3": (32, 4, 2048, 704), "kimi-linear-48b": (256, 8, 2304, 1024),
          "k3-experts": (256, 16, 3584, 3072), "builtin": (8, 2, 128, 128)}
EVERY_EXPERT_MAX_BYTES = 4 << 30
SILU = MoEActivation("silu")


def every_expert(x, w13, w2, weights, ids):
    inter = w13.shape[1] // 2
    dense = torch.zeros(x.shape[0], w13.shape[0], dtype=torch.float32, device=x.device).scatter_(1, ids, weights)
    gate_up = torch.bmm(x.unsqueeze(0).expand(w13.shape[0], -1, -1), w13.transpose(1, 2))
    out = torch.bmm(torch.nn.functional.silu(gate_up[..., :inter]) * gate_up[..., inter:], w2.transpose(1, 2))
    return torch.bmm(dense.unsqueeze(1), out.transpose(0, 1).float()).squeeze(1)


def torch_loop(x, w13, w2, weights, ids):
    inter = w13.shape[1] // 2
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    order = ids.flatten().argsort()
    counts = torch.bincount(ids.flatten(), minlength=w13.shape[0]).tolist()
    tokens, w = order // ids.shape[1], weights.flatten()[order]
    start = 0
    for e, n in enumerate(counts):
        if n:
            tok = tokens[start:start + n]
            g, u = (x[tok] @ w13[e].t()).split(inter, dim=-1)
            y.index_add_(0, tok, ((torch.nn.functional.silu(g) * u) @ w2[e].t()).float() * w[start:start + n, None])
            start += n
    return y


def grouped_mm(x, w13_t, w2_t, weights, ids):
    """w13_t [E, D, 2I] and w2_t [E, I, D]: _grouped_mm takes its right operands K-major."""
    inter = w13_t.shape[2] // 2
    flat = ids.flatten()
    order = flat.argsort()
    counts = torch.zeros(w13_t.shape[0], dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    gate_up = torch._grouped_mm(x[order // ids.shape[1]], w13_t, offs=offs)
    act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    down = torch._grouped_mm(act, w2_t, offs=offs).float() * weights.flatten()[order, None]
    return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, order // ids.shape[1], down)


def sweep_candidates(tokens: int) -> list[tuple[GemmConfig, GemmConfig]]:
    if tokens <= 256:
        return [(GemmConfig(16, bn, bk, 4, st), GemmConfig(16, 2 * bn, bk, 4, st))
                for bn in (16, 32, 64) for bk in (128, 256) for st in (3, 4)]
    fused = [(GemmConfig(bm, bn, 64, w, st), GemmConfig(bm, 2 * bn, 64, w, st))
             for bm in (32, 64, 128) for bn in (64, 128) for w in (4, 8) for st in (3, 4)]
    # the unfused gate/up: one accumulator over all 2I columns, so wider tiles fit
    split = [(GemmConfig(bm, bn, 64, w, st, split_act=True), GemmConfig(bm, 256, 64, w, st))
             for bm in (64, 128) for bn in (128, 256) for w in (4, 8) for st in (3, 4)]
    return fused + split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,4,16,64,256,1024,4096,8192")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="also time candidate tiles for the fused kernels")
    ap.add_argument("--sweep-tokens", default="1,64,8192")
    ap.add_argument("--sweep-shapes", default="kimi-linear-1b3")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", default="benchmarks/results/gpu/fused_moe.json")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    report, bw = bandwidth_report()
    report["cublas_bf16_tflops"] = peak = matmul_peak_tflops()  # the roofline's matmul peak, measured in this run
    report["peak_basis_tflops"] = H200_BF16_DENSE_TFLOPS
    print(f"cuBLAS bf16 8192^3: {peak:.0f} TFLOP/s")
    report["sweep"] = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes.split(","):
        E, k, D, inter = SHAPES[shape]
        w13 = torch.randn(E, 2 * inter, D, device="cuda", dtype=dtype, generator=gen) * 0.02
        w2 = torch.randn(E, D, inter, device="cuda", dtype=dtype, generator=gen) * 0.02
        w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)
        expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
        for T in map(int, args.tokens.split(",")):
            x = torch.randn(T, D, device="cuda", dtype=dtype, generator=gen)
            ids = torch.rand(T, E, device="cuda", generator=gen).topk(k, dim=-1).indices
            weights = torch.rand(T, k, device="cuda", generator=gen)
            chosen = int(ids.unique().numel())
            flops = 2 * T * k * 3 * D * inter
            # bytes: the chosen experts' weights once, x in, the gated activations out and back in, the pair
            # outputs out and back in for the top-k sum, the float32 result out
            nbytes = chosen * expert_bytes + (T * D + 2 * T * k * inter + 2 * T * k * D) * x.element_size() + T * D * 4
            roof_us = roofline_us(nbytes, flops, bw, peak)
            heuristic = pick_config(T * k, E, inter, D, num_sms(x.device), x.element_size(), smem_per_block(x.device))
            tuned = tuned_config(T, E, inter, D, dtype, x.device) is not None
            ref = torch_loop(x, w13, w2, weights, ids)
            peers = {"fused": (lambda: fused_experts(x, w13, w2, weights, ids, SILU), True),
                     # the heuristic's tiles: what `fused` ran before this shape had a tuned table
                     "fused_heuristic": (lambda: fused_experts(x, w13, w2, weights, ids, SILU, tiles=heuristic),
                                         True),
                     "torch_loop": (lambda: torch_loop(x, w13, w2, weights, ids), False),
                     "grouped_mm": (lambda: grouped_mm(x, w13_t, w2_t, weights, ids), True)}
            if E * T * 2 * inter * 2 <= EVERY_EXPERT_MAX_BYTES:
                peers["every_expert"] = (lambda: every_expert(x, w13, w2, weights, ids), True)
            for name, (fn, graph) in peers.items():
                key = f"{shape}/{name}/T={T}"
                try:
                    err = (fn().float() - ref).abs().max().item() / ref.abs().max().item()
                    t = time_graph(fn, reps=20, calls_per_rep=10 if T <= 1024 else 3, graph=graph)
                except (RuntimeError, TypeError) as e:
                    report["skipped"][key] = f"{type(e).__name__}: {e}"[:300]
                    print("skip", key, report["skipped"][key])
                    continue
                us = t["median"]
                row = {"shape": shape, "dtype": args.dtype, "impl": name, "backend": name, "tokens": T, "experts": E,
                       "topk": k, "top_k": k, "tuned_table": tuned, "bytes": nbytes, "flops": flops,
                       "roofline_us": roof_us, "pct_roofline": 100 * roof_us / us,
                       "hidden": D, "inter": inter, "chosen_experts": chosen, "us": t, "rel_err_vs_torch_loop": err,
                       "gbps_chosen_weights": chosen * expert_bytes / (us * 1e-6) / 1e9,
                       "tflops": flops / (us * 1e-6) / 1e12}
                row["pct_copy_bw"] = 100 * row["gbps_chosen_weights"] / bw
                row["pct_hbm_peak"] = 100 * row["gbps_chosen_weights"] / H200_HBM_GBPS
                row["pct_peak"] = 100 * row["tflops"] / H200_BF16_DENSE_TFLOPS
                row["pct_cublas"] = 100 * row["tflops"] / peak
                report["results"].append(row)
                print(f"{key}: {us:9.1f} us  {row['pct_roofline']:5.1f}% roofline  {row['pct_copy_bw']:5.1f}% BW  "
                      f"{row['tflops']:6.1f} TFLOP/s "
                      f"({row['pct_peak']:4.1f}% peak)  rel err {err:.1e}")
            if args.sweep and str(T) in args.sweep_tokens.split(",") and shape in args.sweep_shapes.split(","):
                for up, down in sweep_candidates(T):
                    try:
                        us = time_graph(lambda: fused_experts(x, w13, w2, weights, ids, SILU, tiles=(up, down)),
                                        reps=10, calls_per_rep=5)["median"]
                    except Exception as e:  # noqa: BLE001 -- a tile the compiler cannot fit (OutOfResources)
                        print("sweep skip", up, e)
                        continue
                    report["sweep"].append({"shape": shape, "tokens": T, "up": asdict(up), "down": asdict(down),
                                            "us": us})
                    print(f"  sweep {shape} T={T} up={asdict(up)} down_bn={down.block_n}: {us:.1f} us")
                    write_json(args.out, report)  # a run cut short keeps what it swept
            write_json(args.out, report)
    print(write_json(args.out, report))


if __name__ == "__main__":
    main()
