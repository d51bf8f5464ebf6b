"""Draw a training_log.json of `vllm.tools.train_model` as a loss curve (train batches and held-out evals).

    python benchmarks/plot_training_log.py benchmarks/results/default_model/training_log.json \
        benchmarks/results/default_model/loss_curve.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(log_path: str, png_path: str) -> None:
    log = json.load(open(log_path))
    tokens_per_step = log["steps"][-1]["tokens"] / log["steps"][-1]["step"]
    plt.figure(figsize=(7, 4))
    plt.plot([s["tokens"] / 1e6 for s in log["steps"]], [s["loss"] for s in log["steps"]], label="train (batch)")
    plt.plot([e["step"] * tokens_per_step / 1e6 for e in log["evals"]], [e["heldout_loss"] for e in log["evals"]],
             "o-", label="held-out")
    plt.xlabel("training tokens (M)")
    plt.ylabel("cross-entropy (nats/token)")
    plt.legend()
    plt.grid(alpha=0.3)
    plt.title(f"kimi_k3, {log['params'] / 1e6:.2f}M params, {log['device']}: held-out ppl "
              f"{log['evals'][-1]['heldout_ppl']:.1f}")
    plt.tight_layout()
    plt.savefig(png_path, dpi=100)


if __name__ == "__main__":
    main(*sys.argv[1:3])
