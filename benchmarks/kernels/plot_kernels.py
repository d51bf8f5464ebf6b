"""PNG plots of the kernel benchmark JSONs (run where matplotlib is installed; the GPU machine lacks it).

    python benchmarks/kernels/plot_kernels.py benchmarks/results/gpu/kda_decode.json ...
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _panels(results, panel_keys, x_key, y_of, series_key="backend"):
    panels = defaultdict(lambda: defaultdict(list))
    for r in results:
        panels[tuple(r[k] for k in panel_keys)][r[series_key]].append((r[x_key], y_of(r)))
    return panels


def _pct_bw(r: dict) -> float:
    return r["pct_copy_bw"]  # of the file's pct_basis_gbps (timing.bandwidth_report)


# Tuning sweeps (tune_*.py): one panel per shape, one bar per schedule tried.
_SWEEP_SHAPE_KEYS = ("heads", "batch", "query_len", "context", "state_dtype")
_SWEEP_MEASURES = ("us", "pct_copy_bw", "pct_roofline", "floor_us", "pct_reference_copy_bw", "default")


def plot_sweep(path: Path) -> Path:
    data = json.loads(path.read_text())
    panels = defaultdict(list)
    for r in data["results"]:
        shape = tuple(f"{k}={r[k]}" for k in _SWEEP_SHAPE_KEYS if k in r)
        label = " ".join(f"{k}={v}" for k, v in r.items() if k not in _SWEEP_SHAPE_KEYS + _SWEEP_MEASURES)
        panels[shape].append((label + (" (default)" if r.get("default") else ""), r["us"]["median"]))
    keys = sorted(panels)
    cols = min(3, len(keys))
    rows = -(-len(keys) // cols)
    height = max(len(v) for v in panels.values()) * 0.22 + 1
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, height * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        labels, us = zip(*panels[key])
        best = min(us)
        ax.barh(range(len(us)), us, color=["tab:green" if u == best else "tab:blue" for u in us])
        ax.set_yticks(range(len(us)), labels, fontsize=6)
        ax.invert_yaxis()
        ax.set_title(", ".join(key), fontsize=8)
        ax.set_xlabel("us (median)", fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.suptitle(f"{path.stem} on {data['meta']['device_name']} ({data['meta']['git_commit'][:10]})")
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=80)
    return out


def plot(path: Path) -> Path:
    data = json.loads(path.read_text())
    if "tuning" in path.name:
        return plot_sweep(path)
    res = data["results"]
    if "kda_decode_ab" in path.name:  # ab_kda_decode.py: an earlier kernel against this tree's
        panels = _panels(res, ("state_dtype", "heads"), "batch", lambda r: r["us"]["median"], series_key="kernel")
        xlabel, ylabel, logx = "batch (requests)", "us per layer step (median)", True
    elif "kda_decode" in path.name:
        panels = _panels(res, ("state_dtype", "heads"), "batch", _pct_bw)
        xlabel, ylabel, logx = "batch (requests)", f"% of {data['pct_basis_gbps']:.0f} GB/s copy BW (state r+w)", True
    elif "fused_moe" in path.name:
        panels = _panels(res, ("shape",), "tokens", lambda r: r["us"]["median"], series_key="impl")
        xlabel, ylabel, logx = "tokens", "us per MoE layer (median)", True
    elif "kda_prefill" in path.name:
        panels = _panels(res, ("heads",), "tokens", lambda r: r["ms"]["median"])
        xlabel, ylabel, logx = "prompt tokens", "ms (median)", True
    else:
        panels = _panels([r for r in res if r["heads"] == res[0]["heads"]], ("query_len", "batch"), "context",
                         _pct_bw)
        xlabel, ylabel, logx = "context tokens", f"% of {data['pct_basis_gbps']:.0f} GB/s copy BW (cache read)", True
    keys = sorted(panels)
    cols = min(4, len(keys))
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for name, pts in sorted(panels[key].items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_title(", ".join(map(str, key)))
        if logx:
            ax.set_xscale("log", base=2)
        if "fused_moe" in path.name:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"{path.stem} on {data['meta']['device_name']} ({data['meta']['git_commit'][:10]})")
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=90)
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(plot(Path(arg)))
