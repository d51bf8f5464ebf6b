"""MLA decode per backend over the paged latent cache: context 1K..128K, batch 1..128, 1..8 query tokens.

Each backend runs its whole forward for decode/verify rows (latent-row write, q absorption through W_UK,
attention over the paged cache, V up-projection), replayed in a CUDA graph. Bandwidth counts the latent cache
bytes read (context x (kv_lora_rank + rope) x 2 bytes per request) against the copy bandwidth measured in the
same run. `pct_roofline`: the larger of (cache + absorption weights + q/out bytes) / copy bandwidth and the
FLOPs (QK over rank + rope and PV over rank, per head and query token, plus the two absorptions) / the bf16
matmul peak cuBLAS reaches in the same run, over the measured time: with many heads and query tokens a verify
row is compute-bound. Shapes: 16 heads (the shared 1.3B config) and 64 heads, kv_lora_rank 512, rope 64, block 64.

    python benchmarks/kernels/bench_mla_decode.py --out benchmarks/results/gpu/mla_decode.json
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import write_json  # noqa: E402
from timing import bandwidth_report, matmul_peak_tflops, roofline_us, time_graph  # noqa: E402

from vllm.attention.backend import CommonAttentionMetadata, LayerShapes  # noqa: E402
from vllm.attention.selector import backend_reason, load_backend  # noqa: E402

L, R, NOPE, V, BS = 512, 64, 128, 128, 64


def make_step(H: int, B: int, ctx: int, qlen: int, act=torch.bfloat16):
    seq = ctx + qlen
    nblk = -(-seq // BS)
    blocks = torch.randperm(B * nblk, device="cuda").int().view(B, nblk)  # scattered pages
    kv_cache = torch.randn(B * nblk, BS, L + R, device="cuda", dtype=act)
    pos = torch.arange(ctx, seq, device="cuda")
    slot_mapping = (blocks[:, pos // BS].long() * BS + pos % BS).flatten()
    qsl = torch.arange(B + 1, dtype=torch.int32) * qlen
    seq_lens = torch.full((B,), seq, dtype=torch.int32)
    T = B * qlen
    common = CommonAttentionMetadata(
        query_start_loc=qsl.cuda(), query_start_loc_cpu=qsl, seq_lens=seq_lens.cuda(), seq_lens_cpu=seq_lens,
        num_reqs=B, num_actual_tokens=T, max_query_len=qlen, max_seq_len=seq, block_table=blocks,
        slot_mapping=slot_mapping, is_prefilling=torch.zeros(B, dtype=torch.bool),
        state_indices=torch.zeros(B, dtype=torch.int32, device="cuda"), state_indices_cpu=torch.zeros(B, dtype=torch.int32))
    q = torch.randn(T, H, NOPE + R, device="cuda", dtype=act)
    latent = torch.randn(T, L + R, device="cuda", dtype=act)
    w = torch.randn(H * (NOPE + V), L, device="cuda", dtype=act) * L ** -0.5
    return common, q, latent, kv_cache, w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", default="16,64")
    ap.add_argument("--contexts", default="1024,8192,32768,131072")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--query-lens", default="1,4,8")
    ap.add_argument("--backends", default="TRITON_MLA,FLASHINFER_MLA")
    ap.add_argument("--out", default="benchmarks/results/gpu/mla_decode.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    # Rewritten after every row, so a run cut by a time limit keeps what it measured.
    report, bw = bandwidth_report()
    report["matmul_peak_tflops"] = peak = matmul_peak_tflops()
    results, skipped = report["results"], report["skipped"]
    for H in map(int, args.heads.split(",")):
        shapes = LayerShapes(mla_num_heads=H, kv_lora_rank=L, qk_rope_head_dim=R, block_size=BS)
        names = []
        for name in args.backends.split(","):
            reason = backend_reason("--attention-backend", name, torch.device("cuda"), torch.bfloat16, shapes)
            if reason is None:
                names.append(name)
            else:
                skipped[name] = reason
        for ctx in map(int, args.contexts.split(",")):
            for B in map(int, args.batches.split(",")):
                for qlen in map(int, args.query_lens.split(",")):
                    common, q, latent, kv_cache, w = make_step(H, B, ctx, qlen)
                    cache_bytes = B * (ctx + qlen) * (L + R) * kv_cache.element_size()
                    T = B * qlen
                    nbytes = cache_bytes + (w.numel() + T * H * (NOPE + R + V)) * w.element_size()
                    flops = 2 * T * H * ((ctx + qlen) * (2 * L + R) + L * (NOPE + V))
                    roof = roofline_us(nbytes, flops, bw, peak)
                    for name in names:
                        backend = load_backend("--attention-backend", name)
                        meta = backend.builder(BS).build(common)
                        fn = functools.partial(backend.forward, q, latent, kv_cache, w, NOPE, V, (NOPE + R) ** -0.5, meta)
                        calls = max(2, min(20, int(20e-3 / max(cache_bytes / (bw * 1e9), 5e-6))))
                        t = time_graph(fn, reps=15, calls_per_rep=calls)
                        gbps = cache_bytes / (t["median"] * 1e-6) / 1e9
                        results.append({"backend": name, "heads": H, "context": ctx, "batch": B, "query_len": qlen,
                                        "us": t, "cache_gbps": gbps, "pct_copy_bw": 100 * gbps / bw,
                                        "bytes": nbytes, "flops": flops, "roofline_us": roof,
                                        "pct_roofline": 100 * roof / t["median"]})
                        write_json(args.out, report)
                        print(f"H={H:3} ctx={ctx:6} B={B:4} q={qlen} {name:14} {t['median']:9.1f} us "
                              f"{100 * gbps / bw:5.1f}% of copy BW {100 * roof / t['median']:5.1f}% of roofline",
                              flush=True)
                    del common, q, latent, kv_cache, w
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
