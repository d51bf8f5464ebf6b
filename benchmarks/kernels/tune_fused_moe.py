"""Tunes the fused MoE's tiles per (experts E, intermediate N, hidden K, tokens) on this GPU and writes the tables
the engine reads (layers/fused_moe/tile_configs.py), one JSON file per shape, as upstream's fused-MoE configs.

For each token count: for each BLOCK_M the routing's pairs per expert make sensible, a coordinate descent: the
gate/up tiles (from 64-row blocks up, unfused `split_act` ones too) against a fixed down tile, then the down
tiles against the best gate/up; the fastest pair wins,
timed as the whole fused_experts call (align + both GEMMs + the top-k sum) in CUDA graphs, medians of many.
The heuristic's tiles (fused_moe.pick_config) are timed in the same run: the table keeps the heuristic where
nothing beat it.

    python benchmarks/kernels/tune_fused_moe.py --shapes kimi-linear-48b,k3-experts \
        --log benchmarks/results/gpu/<date>_<device>_tune_fused_moe.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import metadata, write_json  # noqa: E402
from timing import time_graph  # noqa: E402

from vllm.model_executor.layers.fused_moe import MoEActivation, fused_experts  # noqa: E402
from vllm.model_executor.layers.fused_moe.fused_moe import (pick_config, pipelined_smem_bytes,  # noqa: E402
                                                            smem_per_block)
from vllm.model_executor.layers.fused_moe.tile_configs import (CONFIG_DIR, GemmConfig,  # noqa: E402
                                                               config_file_name, device_name, table_to_json)
from vllm.utils import num_sms  # noqa: E402

# (experts, top-k, hidden K, intermediate N): Kimi-Linear-48B-A3B's routed experts; K3's latent experts (they
# read its latent width 3584, intermediate 3072, top-16); the 1.3B benchmark config's.
SHAPES = {"kimi-linear-48b": (256, 8, 2304, 1024), "k3-experts": (256, 16, 3584, 3072),
          "kimi-linear-1b3": (32, 4, 2048, 704)}
TOKENS = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192"
SILU = MoEActivation("silu")


def block_ms(pairs_per_expert: float) -> tuple[int, ...]:
    if pairs_per_expert <= 4:
        return (16,)
    if pairs_per_expert <= 16:
        return (16, 32)
    if pairs_per_expert <= 64:
        return (32, 64)
    return (64, 128)


def tile_grid(bm: int, widths: tuple[int, ...], b_tiles: int, elem: int, smem: int, split_act: bool = False
              ) -> list[GemmConfig]:
    depths = (64, 128, 256) if bm <= 32 else (32, 64, 128)
    grid = (GemmConfig(bm, bn, bk, w, st, split_act)
            for bn, bk, w, st in itertools.product(widths, depths, (4, 8), (3, 4)))
    return [c for c in grid if pipelined_smem_bytes(c, b_tiles, elem) <= smem]


def tune_tokens(run, T: int, E: int, k: int, elem: int, smem: int, log: list) -> tuple[GemmConfig, GemmConfig]:
    def timed(tiles):
        try:
            us = time_graph(lambda: run(tiles), reps=10, calls_per_rep=10 if T <= 1024 else 3)["median"]
        except Exception as e:  # noqa: BLE001 -- a tile the compiler cannot fit (Triton's OutOfResources)
            log.append({"tokens": T, "tiles": repr(tiles), "error": f"{type(e).__name__}: {e}"[:200]})
            return float("inf")
        return us

    best, best_us = None, float("inf")
    for bm in block_ms(T * k / E):
        down = GemmConfig(bm, 128, 64, 4, 3)
        ups = tile_grid(bm, (32, 64, 128) + ((256,) if bm >= 64 else ()), 2, elem, smem)
        if bm >= 64:  # large routings: the unfused gate/up (one accumulator, wider tiles) as well
            ups += tile_grid(bm, (64, 128, 256), 1, elem, smem, split_act=True)
        up = min(ups, key=lambda c: timed((c, down)))
        downs = tile_grid(bm, (64, 128, 256), 1, elem, smem)
        down = min(downs, key=lambda c: timed((up, c)))
        us = timed((up, down))
        if us < best_us:
            best, best_us = (up, down), us
    return best, best_us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="kimi-linear-48b")
    ap.add_argument("--tokens", default=TOKENS, help="token counts to tune (a shape may override with name:T,...)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--out-dir", default=str(CONFIG_DIR), help="where the tables go (the engine reads CONFIG_DIR)")
    ap.add_argument("--log", default="benchmarks/results/gpu/tune_fused_moe.json")
    args = ap.parse_args()
    dtype, dev = getattr(torch, args.dtype), torch.device("cuda")
    elem, smem = dtype.itemsize, smem_per_block(dev)
    report = {"meta": metadata("cuda"), "device_name": device_name(dev), "tables": {}, "rows": [], "errors": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes.split(","):
        E, k, D, inter = SHAPES[shape]
        w13 = torch.randn(E, 2 * inter, D, device="cuda", dtype=dtype, generator=gen) * 0.02
        w2 = torch.randn(E, D, inter, device="cuda", dtype=dtype, generator=gen) * 0.02
        name = config_file_name(E, inter, D, device_name(dev), dtype)
        table = {}
        for T in map(int, args.tokens.split(",")):
            t0 = time.perf_counter()
            x = torch.randn(T, D, device="cuda", dtype=dtype, generator=gen)
            ids = torch.rand(T, E, device="cuda", generator=gen).topk(k, dim=-1).indices
            weights = torch.rand(T, k, device="cuda", generator=gen)

            def run(tiles, x=x, ids=ids, weights=weights):
                return fused_experts(x, w13, w2, weights, ids, SILU, tiles=tiles)
            heuristic = pick_config(T * k, E, inter, D, num_sms(dev), elem, smem)
            heuristic_us = time_graph(lambda: run(heuristic), reps=10, calls_per_rep=10 if T <= 1024 else 3)["median"]
            tiles, us = tune_tokens(run, T, E, k, elem, smem, report["errors"])
            if tiles is None or us >= heuristic_us:
                tiles, us = heuristic, heuristic_us
            table[T] = tiles
            report["rows"].append({"shape": shape, "experts": E, "topk": k, "N": inter, "K": D, "tokens": T,
                                   "tuned_us": us, "heuristic_us": heuristic_us, "speedup": heuristic_us / us,
                                   "up": repr(tiles[0]), "down": repr(tiles[1])})
            print(f"{shape} T={T}: {us:8.1f} us (heuristic {heuristic_us:8.1f}, x{heuristic_us / us:.2f}) "
                  f"{tiles}  [{time.perf_counter() - t0:.0f} s]", flush=True)
            out = Path(args.out_dir) / name  # rewritten after every token count: a cut run keeps what it tuned
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(table_to_json(table), indent=1) + "\n")
            report["tables"][name] = table_to_json(table)
            write_json(args.log, report)
    print(write_json(args.log, report))


if __name__ == "__main__":
    main()
