"""Train a DSpark draft for a target model on the standard-library corpus (`vllm.tools.prepare_corpus`).

    python -m vllm.tools.train_dspark --tokens .train/corpus --out .train/dspark --time-budget-s 300

The target (default: the built-in model) is frozen; each step runs it over `--batch` windows of `--seq-len`
tokens (`vllm.tools.training_forward`, no grad) and keeps its hidden states at the draft's target_layer_ids and
its next-token distributions p. For `--anchors` random positions a per window, the block [x_a, mask x K-1] at
positions a..a+K-1 sees the context below a and itself whole (one attention call for all anchors: a mask keeps
each block to its own context and tokens); block position i predicts the token after a+i. Losses, as the DSpark
paper trains: cross-entropy of the draft's q_i (lm_head + Markov bias of the data token at a+i, teacher forcing)
against the target's p_{a+i}, plus `--confidence-alpha` x BCE of the confidence head against the per-position
acceptance a_i = sum_v min(p, q), weighted by the detached reach prod_{j<i} a_j. Evaluation on the held-out split
reports per position: the greedy match rate (argmax q = argmax p), the mean acceptance a_i, the mean confidence,
and the calibration (acceptance against confidence in ten bins). Writes OUT/config.json, OUT/model.safetensors
(bf16; the confidence head float32) and OUT/training_log.json.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from vllm.assets import DEFAULT_MODEL_DIR
from vllm.model_executor.model_loader import load_model
from vllm.model_executor.models.dspark.model import DSparkDraftModel
from vllm.tools.make_dspark_draft import dspark_config_for, random_draft_state_dict
from vllm.tools.train_model import lr_at, windows
from vllm.tools.training_forward import training_logits
from vllm.transformers_utils.configs.dspark import DSparkConfig

CALIBRATION_BINS = 10


def target_features(target, tokens: torch.Tensor, layer_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states [B, T, n * D] after layer_ids, next-token distributions p [B, T, V] float32)."""
    captured = {}

    def keep(layer: int, h: torch.Tensor) -> None:
        if layer in layer_ids:
            captured[layer] = h

    with torch.no_grad():
        logits = training_logits(target, tokens, layer_output=keep)
        return torch.cat([captured[i] for i in layer_ids], dim=-1), logits.float().softmax(-1)


def block_forward(draft: DSparkDraftModel, target, tokens: torch.Tensor, hidden: torch.Tensor,
                  anchors: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every anchor's block over windows tokens [B, T]: (logits [B, A, K, V] float32, final hidden [B, A, K, D],
    previous tokens [B, A, K]) for anchors [A] (each <= T - K)."""
    B, T = tokens.shape
    A = anchors.shape[0]
    device = tokens.device
    seq = torch.arange(T, device=device)
    contexts = draft.context_latents(hidden, seq.expand(B, T))
    positions = (anchors[:, None] + torch.arange(K, device=device)).flatten()  # [A*K]
    block_of = torch.arange(A, device=device).repeat_interleave(K)
    mask = torch.cat([seq[None, :] < anchors[block_of][:, None], block_of[:, None] == block_of[None, :]], dim=1)
    x = draft.block_inputs(tokens[:, anchors], K, target.model.embed_tokens).flatten(1, 2)  # [B, A*K, D]
    h = draft.backbone(x, positions.expand(B, -1), contexts, mask.expand(B, -1, -1))
    prev = tokens[:, positions]  # position i's previous token: the anchor, then the data tokens (teacher forcing)
    logits = draft.markov_logits(h @ target.lm_head.weight.t().to(h.dtype), prev)
    return logits.view(B, A, K, -1), h.view(B, A, K, -1), prev.view(B, A, K)


def losses(draft, target, batch: torch.Tensor, anchors: torch.Tensor, K: int, alpha: float) -> dict:
    tokens = batch[:, :-1]
    hidden, p = target_features(target, tokens, draft.config.target_layer_ids)
    logits, h, prev = block_forward(draft, target, tokens, hidden, anchors, K)
    positions = anchors[:, None] + torch.arange(K, device=anchors.device)  # [A, K]
    p_block = p[:, positions]  # [B, A, K, V]
    log_q = logits.log_softmax(-1)
    ce = -(p_block * log_q).sum(-1)
    accept = torch.minimum(p_block, log_q.exp()).sum(-1).detach()  # a_i = sum_v min(p, q)
    reach = torch.cat([torch.ones_like(accept[..., :1]), accept[..., :-1].cumprod(-1)], dim=-1)
    conf = draft.confidence(h, prev)
    with torch.autocast(conf.device.type, enabled=False):  # BCE on probabilities is float32-only
        bce = F.binary_cross_entropy(conf.float(), accept.float().clamp(0, 1), weight=reach.float())
    return {"loss": ce.mean() + alpha * bce, "ce": ce.mean(), "bce": bce, "accept": accept, "conf": conf.detach(),
            "match": (logits.argmax(-1) == p_block.argmax(-1)).float()}


@torch.no_grad()
def evaluate(draft, target, heldout: torch.Tensor, K: int, batch: int, anchors_per_window: int,
             device: str) -> dict:
    """Per-position greedy match, acceptance and confidence over the held-out windows, and calibration bins."""
    gen = torch.Generator().manual_seed(0)
    match, accept, conf = [], [], []
    for i in range(0, len(heldout), batch):
        ids = heldout[i:i + batch].to(device)
        T = ids.shape[1] - 1
        anchors = torch.randperm(T - K + 1, generator=gen)[:anchors_per_window].to(device)
        with torch.autocast("cuda", torch.bfloat16, enabled=device == "cuda"):
            out = losses(draft, target, ids, anchors, K, 0.0)
        match.append(out["match"].flatten(0, 1))
        accept.append(out["accept"].flatten(0, 1))
        conf.append(out["conf"].flatten(0, 1))
    match, accept, conf = torch.cat(match), torch.cat(accept), torch.cat(conf)
    bins = []
    edges = torch.linspace(0, 1, CALIBRATION_BINS + 1, device=conf.device)
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (conf >= lo) & ((conf < hi) | (hi == 1))
        if inside.any():
            bins.append({"confidence": [lo.item(), hi.item()], "count": int(inside.sum()),
                         "mean_confidence": conf[inside].mean().item(),
                         "mean_acceptance": accept[inside].mean().item()})
    ece = sum(b["count"] * abs(b["mean_confidence"] - b["mean_acceptance"]) for b in bins) / conf.numel()
    return {"greedy_match_per_pos": match.mean(0).tolist(), "acceptance_per_pos": accept.mean(0).tolist(),
            "confidence_per_pos": conf.mean(0).tolist(), "calibration": bins, "expected_calibration_error": ece}


def save(draft: DSparkDraftModel, config: dict, out: Path, log: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {n: (p.detach().float() if n.startswith("confidence_head.") else p.detach().to(torch.bfloat16)).cpu()
               .contiguous() for n, p in draft.named_parameters()}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")


def train(args: argparse.Namespace) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    target = load_model(args.target, "float32", device)
    config = dspark_config_for(args.target, num_layers=args.layers)
    draft = DSparkDraftModel(DSparkConfig.from_json_dict(config, "train_dspark"))
    draft.load_state_dict(random_draft_state_dict(config, args.seed))
    draft.to(device).train()
    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    train_tokens = np.load(args.tokens / "train_tokens.npy")
    heldout = windows(np.load(args.tokens / "heldout_tokens.npy"), args.seq_len + 1)[:args.max_eval_windows]
    gen = torch.Generator().manual_seed(args.seed)
    K = args.num_speculative_tokens
    log = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "target": str(args.target),
           "params": sum(p.numel() for p in draft.parameters()), "config": config,
           "args": {k: str(v) for k, v in vars(args).items()}, "steps": [], "evals": []}
    print(f"draft: {log['params'] / 1e6:.2f}M parameters, K={K}, device {log['device']}", flush=True)
    step, start, total = 0, time.perf_counter(), args.max_steps
    while step < total:
        starts = torch.randint(0, len(train_tokens) - args.seq_len - 1, (args.batch,), generator=gen).numpy()
        batch = torch.from_numpy(np.stack([train_tokens[s:s + args.seq_len + 1] for s in starts]).astype(np.int64))
        batch = batch.to(device)
        anchors = torch.randperm(args.seq_len - K + 1, generator=gen)[:args.anchors].to(device)
        lr = lr_at(step, total, args.warmup, args.lr, args.lr * 0.1)
        for group in opt.param_groups:
            group["lr"] = lr
        # The context path reads the layers' kv_a weights through one stacked copy: restacked each step, the
        # gradient reaches the layers' own weights (which are what is saved).
        draft.process_weights_after_loading()
        with torch.autocast("cuda", torch.bfloat16, enabled=device == "cuda"):
            out = losses(draft, target, batch, anchors, K, args.confidence_alpha)
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        elapsed = time.perf_counter() - start
        if args.time_budget_s and step == args.timing_steps:
            warm_time = elapsed  # the target's kernels compiled and autotuned by now
        if args.time_budget_s and step == 2 * args.timing_steps:
            per_step = (elapsed - warm_time) / args.timing_steps
            total = min(args.max_steps, step + int((args.time_budget_s - elapsed) / per_step))
            log["total_steps"] = total
            print(f"{per_step * 1e3:.0f} ms/step -> {total} steps", flush=True)
        if step % args.log_every == 0 or step == total:
            log["steps"].append({"step": step, "loss": out["loss"].item(), "ce": out["ce"].item(),
                                 "bce": out["bce"].item(), "lr": lr, "elapsed_s": elapsed,
                                 "acceptance_per_pos": out["accept"].mean((0, 1)).tolist()})
            print(json.dumps(log["steps"][-1]), flush=True)
    draft.eval()
    draft.process_weights_after_loading()
    log["heldout"] = evaluate(draft, target, heldout, K, args.batch, args.anchors, device)
    log["train_time_s"] = time.perf_counter() - start
    print(json.dumps({k: v for k, v in log["heldout"].items() if k != "calibration"}), flush=True)
    save(draft, config, args.out, log)
    return log


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=Path, required=True, help="prepare_corpus output with the token files")
    ap.add_argument("--target", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--num-speculative-tokens", type=int, default=8, help="block length K trained for")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--anchors", type=int, default=48, help="anchor positions per window")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--confidence-alpha", type=float, default=1.0)
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--time-budget-s", type=float, default=0.0, help="0: run --max-steps")
    ap.add_argument("--timing-steps", type=int, default=20)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--max-eval-windows", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> None:
    train(build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
