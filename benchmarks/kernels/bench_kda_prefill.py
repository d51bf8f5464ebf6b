"""KDA prefill per backend: one prompt of T = 512..16384 tokens at 32 and 96 heads (K=V=128, bf16), or
`--prompts N` prompts of T tokens each.

Each backend runs its whole prefill (conv, chunked KDA with the initial state gathered from the pool and the
final state scattered back, gated RMSNorm). The peers are fla-core's `chunk_kda` alone (in-kernel gate, l2norm,
beta sigmoid, fp32 initial state, final state out) and, where it is importable, FlashKDA's `flash_kda.fwd` alone
on the same inputs, measured in the same run. Eager calls timed with CUDA events, medians of many: back to
back (`ms`: where a call's host time exceeds its GPU time the figure is the host time), and queued behind a
sleep kernel (`gpu_ms`: the kernels alone, as in a step whose host work overlaps the GPU's).

The `triton` backend runs short chunks through fla's recurrent kernel and long ones through chunk_kda; rows
`triton_recurrent` and `triton_chunked` force each path at every length, which is how its
`recurrent_prefill_max_len` was set:

    python benchmarks/kernels/bench_kda_prefill.py --out benchmarks/results/gpu/kda_prefill.json
    python benchmarks/kernels/bench_kda_prefill.py --heads 16 --prompts 1,16 --lengths 16,64,256,512,1024,2048 \
        --backends triton_recurrent,triton_chunked --out benchmarks/results/gpu/kda_short_prefill.json
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import metadata, write_json  # noqa: E402
from bench_kda_decode import K, W, make_layer  # noqa: E402
from timing import time_gpu_only, time_graph  # noqa: E402

from vllm.attention.backend import LayerShapes  # noqa: E402
from vllm.attention.kda.metadata import KDARows  # noqa: E402
from vllm.attention.selector import backend_reason, load_backend  # noqa: E402


def make_prompt(H: int, T: int, act=torch.bfloat16, N: int = 1):
    """N fresh prompts of T tokens each, in state slots 1..N."""
    P = H * K
    qsl = torch.arange(0, N * T + 1, T, dtype=torch.int32)
    slots = torch.arange(1, N + 1, dtype=torch.int32)
    rows = KDARows(query_start_loc=qsl.cuda(), query_start_loc_cpu=qsl, state_indices=slots.cuda(),
                   state_indices_cpu=slots, has_initial_state=torch.zeros(N, dtype=torch.bool, device="cuda"),
                   has_initial_state_cpu=torch.zeros(N, dtype=torch.bool), num_reqs=N, num_tokens=N * T,
                   max_query_len=T)
    NT = N * T
    inputs = (torch.randn(NT, 3 * P, device="cuda", dtype=act), torch.randn(NT, P, device="cuda", dtype=act),
              torch.randn(NT, H, device="cuda", dtype=act), torch.randn(NT, P, device="cuda", dtype=act))
    conv = torch.randn(N + 1, 3 * P, W - 1, device="cuda", dtype=act)
    ssm = torch.zeros(N + 1, H, K, K, device="cuda")
    return rows, inputs, conv, ssm


def forced_path(recurrent: bool, layer, rows, inputs, conv, ssm):
    """The triton backend's prefill with its recurrent / chunked choice forced, whatever the length."""
    from vllm.attention.kda.triton_fla import TritonFLAKDABackend

    def run():
        limits = TritonFLAKDABackend.recurrent_prefill_max_len, TritonFLAKDABackend.recurrent_prefill_max_tokens
        TritonFLAKDABackend.recurrent_prefill_max_len = rows.max_query_len if recurrent else 0
        TritonFLAKDABackend.recurrent_prefill_max_tokens = rows.num_tokens
        try:
            return TritonFLAKDABackend.forward_prefill(layer, *inputs, conv, ssm, rows)
        finally:
            TritonFLAKDABackend.recurrent_prefill_max_len, TritonFLAKDABackend.recurrent_prefill_max_tokens = limits
    return run


def fla_chunk_only(layer, rows, inputs):
    from fla.ops.kda import chunk_kda
    T, H = rows.num_tokens, layer.num_heads
    q, k, v = (x.contiguous().view(1, T, H, K) for x in inputs[0].chunk(3, dim=-1))
    g, beta = inputs[1].view(1, T, H, K), inputs[2].view(1, T, H)
    h0 = torch.zeros(rows.num_reqs, H, K, K, device="cuda")
    cu, cu_cpu = rows.query_start_loc.long(), rows.query_start_loc_cpu.long()
    return lambda: chunk_kda(q, k, v, g, beta, scale=K ** -0.5, initial_state=h0, output_final_state=True,
                             use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                             safe_gate=True, lower_bound=layer.gate_lower_bound, state_v_first=True, cu_seqlens=cu,
                             cu_seqlens_cpu=cu_cpu, A_log=layer.A_log, dt_bias=layer.dt_bias)


def flashkda_only(layer, rows, inputs):
    """flash_kda.fwd alone, or None where it is not importable."""
    try:
        import flash_kda
    except ImportError:
        return None
    T, H = rows.num_tokens, layer.num_heads
    q, k, v = (x.contiguous().view(1, T, H, K) for x in inputs[0].chunk(3, dim=-1))
    g, beta = inputs[1].view(1, T, H, K), inputs[2].view(1, T, H)
    h0 = torch.zeros(rows.num_reqs, H, K, K, device="cuda")
    out, final = torch.empty_like(v), torch.empty_like(h0)
    A_log, dt_bias = layer.A_log.float(), layer.dt_bias.float().view(H, K)
    return lambda: flash_kda.fwd(q, k, v, g, beta, K ** -0.5, out, A_log, dt_bias, float(layer.gate_lower_bound),
                                 initial_state=h0, final_state=final, cu_seqlens=rows.query_start_loc.long())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", default="32,96")
    ap.add_argument("--lengths", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--prompts", default="1", help="comma list: prompts of T tokens each in one call")
    ap.add_argument("--backends", default="triton,flashkda,flashinfer")
    ap.add_argument("--out", default="benchmarks/results/gpu/kda_prefill.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    results, skipped = [], {}
    # Rewritten after every row, so a run cut by a time limit keeps what it measured.
    report = {"meta": metadata("cuda"), "skipped": skipped, "results": results}
    for H in map(int, args.heads.split(",")):
        layer = make_layer(H)
        shapes = LayerShapes(kda_num_heads=H, kda_head_dim=K, kda_gate_bounded=True, ssm_state_dtype=torch.float32)
        for N, T in ((n, t) for n in map(int, args.prompts.split(",")) for t in map(int, args.lengths.split(","))):
            rows, inputs, conv, ssm = make_prompt(H, T, N=N)
            runs = {"fla_chunk_kda_only": fla_chunk_only(layer, rows, inputs)}
            if (alone := flashkda_only(layer, rows, inputs)) is not None:
                runs["flash_kda_fwd_only"] = alone
            for name in args.backends.split(","):
                if name in ("triton_recurrent", "triton_chunked"):
                    runs[name] = forced_path(name == "triton_recurrent", layer, rows, inputs, conv, ssm)
                    continue
                reason = backend_reason("--kda-prefill-backend", name, torch.device("cuda"), torch.bfloat16, shapes)
                if reason is not None:
                    skipped[name] = reason
                    continue
                backend = load_backend("--kda-prefill-backend", name)
                runs[name] = functools.partial(backend.forward_prefill, layer, *inputs, conv, ssm, rows)
            for name, fn in runs.items():
                t = time_graph(fn, reps=20, calls_per_rep=5, graph=False)
                g = time_gpu_only(fn)
                results.append({"backend": name, "heads": H, "prompts": N, "tokens": T,
                                "ms": {k: v / 1e3 if k != "n" else v for k, v in t.items()},
                                "gpu_ms": {k: v / 1e3 if k != "n" else v for k, v in g.items()}})
                write_json(args.out, report)
                print(f"H={H:3} N={N:3} T={T:6} {name:20} {t['median'] / 1e3:8.3f} ms, GPU alone "
                      f"{g['median'] / 1e3:8.3f} ms", flush=True)


if __name__ == "__main__":
    main()
