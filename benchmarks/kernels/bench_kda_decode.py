"""KDA decode per backend: batch 1..256 x heads {12, 32, 96}, K=V=128, fp32 and bf16 state, bf16 activations.

Each backend runs its whole decode step (conv-state update, gate, recurrence, gated RMSNorm) over a state
pool at scattered slots, replayed in a CUDA graph. The peer is fla-core's `fused_recurrent_kda_fwd` kernel
alone (in-kernel gate/l2norm/beta, pool indices, [slots, H, V, K]) measured in the same run. Bandwidth counts
state bytes read + written, against the device-to-device copy bandwidth measured in the same run.

    python benchmarks/kernels/bench_kda_decode.py --out benchmarks/results/gpu/kda_decode.json
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import write_json  # noqa: E402
from timing import bandwidth_report, matmul_peak_tflops, roofline_us, time_graph  # noqa: E402

from vllm.attention.backend import LayerShapes  # noqa: E402
from vllm.attention.kda.metadata import KDARows  # noqa: E402
from vllm.attention.selector import backend_reason, load_backend  # noqa: E402
from vllm.model_executor.layers.layernorm import RMSNormGated  # noqa: E402

K = 128
W = 4


def make_layer(H: int, device: str = "cuda") -> SimpleNamespace:
    P = H * K
    return SimpleNamespace(num_heads=H, head_dim=K, gate_lower_bound=-5.0,
                           conv_weight=torch.randn(3 * P, W, device=device) * 0.5,
                           A_log=torch.randn(H, device=device) * 0.5, dt_bias=torch.randn(P, device=device) * 0.5,
                           o_norm=RMSNormGated(K).to(device))


def make_step(H: int, B: int, state_dtype: torch.dtype, act=torch.bfloat16):
    P = H * K
    slots = torch.randperm(B, device="cuda").int()
    qsl = torch.arange(B + 1, dtype=torch.int32)
    rows = KDARows(query_start_loc=qsl.cuda(), query_start_loc_cpu=qsl, state_indices=slots,
                   state_indices_cpu=slots.cpu(), has_initial_state=torch.ones(B, dtype=torch.bool, device="cuda"),
                   has_initial_state_cpu=torch.ones(B, dtype=torch.bool), num_reqs=B, num_tokens=B, max_query_len=1)
    inputs = (torch.randn(B, 3 * P, device="cuda", dtype=act), torch.randn(B, P, device="cuda", dtype=act),
              torch.randn(B, H, device="cuda", dtype=act), torch.randn(B, P, device="cuda", dtype=act))
    conv = torch.randn(B, 3 * P, W - 1, device="cuda", dtype=act)
    ssm = (torch.randn(B, H, K, K, device="cuda") * 0.1).to(state_dtype)
    return rows, inputs, conv, ssm


def fla_kernel_only(layer, rows, inputs, ssm):
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    B, H = rows.num_tokens, layer.num_heads
    q, k, v = (x.contiguous().view(1, B, H, K) for x in inputs[0].chunk(3, dim=-1))
    g, beta = inputs[1].view(1, B, H, K), inputs[2].view(1, B, H)
    out = torch.empty_like(v)
    return lambda: fused_recurrent_kda_fwd(
        q, k, v, g, beta, A_log=layer.A_log, dt_bias=layer.dt_bias, initial_state=ssm, scale=K ** -0.5,
        inplace_final_state=True, state_v_first=True, cu_seqlens=rows.query_start_loc,
        ssm_state_indices=rows.state_indices, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=layer.gate_lower_bound, out=out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", default="12,32,96")
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--backends", default="native,triton,flashinfer")
    ap.add_argument("--out", default="benchmarks/results/gpu/kda_decode.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    # Rewritten after every row, so a run cut by a time limit keeps what it measured.
    report, bw = bandwidth_report()
    report["matmul_peak_tflops"] = peak = matmul_peak_tflops()
    results, skipped = report["results"], report["skipped"]
    for state_dtype in (torch.float32, torch.bfloat16):
        for H in map(int, args.heads.split(",")):
            layer = make_layer(H)
            shapes = LayerShapes(kda_num_heads=H, kda_head_dim=K, kda_gate_bounded=True, ssm_state_dtype=state_dtype)
            for B in map(int, args.batches.split(",")):
                rows, inputs, conv, ssm = make_step(H, B, state_dtype)
                runs = {"fla_kernel_only": fla_kernel_only(layer, rows, inputs, ssm)}
                for name in args.backends.split(","):
                    reason = backend_reason("--kda-decode-backend", name, torch.device("cuda"), torch.bfloat16, shapes)
                    if reason is not None:
                        skipped[name] = reason
                        continue
                    backend = load_backend("--kda-decode-backend", name)
                    runs[name] = functools.partial(backend.forward_decode, layer, *inputs, conv, ssm, rows)
                state_bytes = 2 * B * H * K * K * ssm.element_size()
                # + q, k, v, gate and output rows (bf16); FLOPs: decay, two rank-1 products and the readout
                roof = roofline_us(state_bytes + 5 * B * H * K * 2, 8 * B * H * K * K, bw, peak)
                for name, fn in runs.items():
                    t = time_graph(fn)
                    gbps = state_bytes / (t["median"] * 1e-6) / 1e9
                    results.append({"backend": name, "heads": H, "batch": B, "state_dtype": str(state_dtype)[6:],
                                    "us": t, "state_gbps": gbps, "pct_copy_bw": 100 * gbps / bw,
                                    "roofline_us": roof, "pct_roofline": 100 * roof / t["median"]})
                    write_json(args.out, report)
                    print(f"{str(state_dtype)[6:]:8} H={H:3} B={B:4} {name:16} {t['median']:9.1f} us "
                          f"{100 * gbps / bw:5.1f}% of copy BW", flush=True)


if __name__ == "__main__":
    main()
