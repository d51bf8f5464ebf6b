"""Sweeps the TRITON_MLA latent-attention kernel's tiles and split counts at decode and verify shapes.

For each shape (heads, batch, query tokens, context) it times the attention kernel alone (split kernel and
merge, CUDA-graph replays) for every tile in TILES with the automatic split count, then the best tile over
a range of split counts, and the whole backend forward (latent write, W_UK / W_UV bmms) at the defaults.
Percentages: of the copy bandwidth over the latent cache bytes, and of the roofline, the larger of the
cache bytes over bandwidth and the dots' FLOPs over the bf16 tensor rate measured on this H200.

    python benchmarks/kernels/tune_mla_decode.py --out benchmarks/results/gpu/mla_decode_tuning.json
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import write_json  # noqa: E402
from bench_mla_decode import BS, NOPE, V, L, R, make_step  # noqa: E402
from timing import bandwidth_report, time_graph  # noqa: E402

from vllm.attention.mla import triton_mla_kernels as kernels  # noqa: E402
from vllm.attention.mla.triton_mla import TritonMLABackend  # noqa: E402
from vllm.utils import num_sms  # noqa: E402

# ../shared/docs/kernels.md: bf16 dense matmul rate measured on this H200.
BF16_TFLOPS = 790.0
SHAPES = [(16, 1, 1, 8192), (16, 1, 1, 131072), (16, 8, 1, 32768), (16, 64, 1, 8192), (16, 128, 1, 32768),
          (16, 8, 4, 32768), (16, 32, 8, 8192), (64, 1, 1, 32768), (64, 32, 1, 8192), (64, 8, 4, 32768),
          (128, 16, 1, 8192), (128, 4, 8, 8192)]
# The five best of the first sweep's twelve (benchmarks/results/gpu/mla_decode_tuning_a51f18f.json).
TILES = [kernels.TileConfig(*t) for t in [(16, 32, 4, 2), (16, 64, 8, 3), (16, 128, 8, 2), (32, 64, 8, 2),
                                          (64, 64, 8, 2)]]
SPLITS = [1, 2, 4, 8, 16, 32, 64, 128]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=None, help="H:B:q:ctx,... (default: SHAPES)")
    ap.add_argument("--tiles", default=None, help="block_m:block_n:warps:stages,... (default: TILES)")
    ap.add_argument("--out", default="benchmarks/results/gpu/mla_decode_tuning.json")
    args = ap.parse_args()
    tiles = TILES if args.tiles is None else [kernels.TileConfig(*map(int, t.split(":"))) for t in
                                              args.tiles.split(",")]
    shapes = SHAPES if args.shapes is None else [tuple(map(int, s.split(":"))) for s in args.shapes.split(",")]
    torch.manual_seed(0)
    report, bw = bandwidth_report()
    report["bf16_tflops"] = BF16_TFLOPS
    results = report["results"]
    scale = (NOPE + R) ** -0.5
    for H, B, qlen, ctx in shapes:
        common, q, latent, kv_cache, w = make_step(H, B, ctx, qlen)
        meta = TritonMLABackend.builder(BS).build(common)
        T, seq = B * qlen, ctx + qlen
        q_lat = torch.randn(H, T, L, device="cuda", dtype=q.dtype)
        q_rope = q[..., NOPE:]
        cache_bytes = B * seq * (L + R) * kv_cache.element_size()
        flops = 2 * B * qlen * H * seq * (L + R + L)
        floor_us = max(cache_bytes / (bw * 1e9), flops / (BF16_TFLOPS * 1e12)) * 1e6
        calls = max(2, min(20, int(20e-3 / max(cache_bytes / (bw * 1e9), 5e-6))))

        def run(label, fn, **extra):
            t = time_graph(fn, reps=10, calls_per_rep=calls)
            row = {"heads": H, "batch": B, "query_len": qlen, "context": ctx, "what": label, **extra, "us": t,
                   "pct_copy_bw": 100 * cache_bytes / (t["median"] * 1e-6) / 1e9 / bw,
                   "pct_roofline": 100 * floor_us / t["median"], "floor_us": floor_us}
            results.append(row)
            write_json(args.out, report)
            print(f"H={H:3} B={B:3} q={qlen} ctx={ctx:6} {label:8} {extra} {t['median']:9.1f} us "
                  f"{row['pct_copy_bw']:5.1f}% bw {row['pct_roofline']:5.1f}% roofline", flush=True)
            return t["median"]

        attention = functools.partial(kernels.latent_attention, q_lat, q_rope, kv_cache, meta.query_start_loc,
                                      meta.seq_lens, meta.block_table, B, qlen, seq, scale)
        default_tile = kernels.tile_config(kv_cache.dtype, qlen * H, triton.next_power_of_2(L))
        timed = {}
        for tile in tiles:
            splits = kernels.auto_num_splits(B, qlen * H, tile.block_m, L, seq, (L + R) * kv_cache.element_size(),
                                             num_sms(q.device))
            try:
                timed[tile] = run("tile", functools.partial(attention, tile=tile), tile=tile_list(tile),
                                  splits=splits, default=tile == default_tile)
            except Exception as e:  # noqa: BLE001 -- a tile past the card's shared memory or registers
                report["skipped"][f"H={H} B={B} q={qlen} ctx={ctx} {tile}"] = f"{type(e).__name__}: {e}"[:200]
                print("skip", tile, type(e).__name__, flush=True)
        best = min(timed, key=timed.get)
        for splits in SPLITS:
            if splits * B * qlen * H * L * 4 > 4 << 30 or (splits - 1) * 64 > seq:
                continue
            run("splits", functools.partial(attention, num_splits=splits, tile=best), tile=tile_list(best),
                splits=splits)
        run("forward", functools.partial(TritonMLABackend.forward, q, latent, kv_cache, w, NOPE, V, scale, meta),
            tile=tile_list(default_tile))
        del common, q, latent, kv_cache, w, q_lat
        torch.cuda.empty_cache()


def tile_list(tile: kernels.TileConfig) -> list[int]:
    return [tile.block_m, tile.block_n, tile.num_warps, tile.num_stages]


if __name__ == "__main__":
    main()
