"""Train the built-in Kimi-K3 model on the standard-library corpus (`vllm.tools.prepare_corpus`).

    python -m vllm.tools.train_model --tokens .train/corpus --tokenizer .train/tok --out .train/model \
        --time-budget-s 420

Random windows of `--seq-len` + 1 tokens from the training stream; AdamW with warmup and cosine decay over a
step count fixed after timing the first steps against `--time-budget-s`; bf16 autocast on CUDA (fp32 master
weights); the router's e_score_correction_bias follows the aux-loss-free rule (each step it moves by
`--bias-update-rate` towards equal expert loads) rather than the gradient. The held-out split is scored every
`--eval-every` steps over all of its tokens in `--seq-len` windows. Writes OUT/config.json, the fp32 weights
sharded below 16 MiB (safetensors), the tokenizer files and OUT/training_log.json (losses, timings, held-out
loss and perplexity). The forward is `vllm.tools.training_forward` (fla-core's chunk_kda backward on CUDA).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from vllm.attention.selector import reference_backends
from vllm.model_executor.models.kimi_k3.model import KimiK3ForCausalLM
from vllm.tools.make_tiny_model import TOKENIZER_FILES, checkpoint_layout, wrap_k3, write_checkpoint
from vllm.tools.training_forward import training_logits
from vllm.transformers_utils.configs.kimi_k3 import KimiK3TextConfig


def default_text_config(vocab_size: int) -> dict:
    """The built-in model: 8 layers (KDA:MLA 3:1), latent MoE with a shared expert, AttnRes, bounded gate."""
    return dict(
        model_type="kimi_linear", vocab_size=vocab_size, hidden_size=256, intermediate_size=768,
        moe_intermediate_size=128, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
        q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        num_experts=8, num_experts_per_token=2, num_shared_experts=1, num_expert_group=1, topk_group=1,
        routed_scaling_factor=1.0, hidden_act="situ", rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, first_k_dense_replace=1, moe_renormalize=True, tie_word_embeddings=False,
        max_position_embeddings=8192,
        linear_attn_config={"kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8], "head_dim": 64,
                            "num_heads": 4, "short_conv_kernel_size": 4, "use_full_rank_gate": True,
                            "gate_lower_bound": -5.0},
        mla_use_output_gate=True, mla_use_nope=True, routed_expert_hidden_size=128, latent_moe_use_norm=True,
        attn_res_block_size=2, activation_situ_beta=4.0, activation_situ_linear_beta=25.0)


def init_weights(model: KimiK3ForCausalLM, seed: int) -> None:
    """Normal(0, 0.02) matrices, output projections scaled by 1/sqrt(2 * layers), unit norms, zero AttnRes
    projections (uniform mixtures at first), and KDA decay rates spread over time scales: with A = 1 and
    dt_bias in [-6, 0] the bounded gate 5 * sigmoid(dt_bias) gives per-token log-decays from -0.012 to -2.5."""
    gen = torch.Generator().manual_seed(seed)
    out_scale = (2 * model.config.num_hidden_layers) ** -0.5
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("A_log"):
                p.zero_()
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(-6.0, 0.0, generator=gen))
            elif name.endswith("e_score_correction_bias") or name.endswith("_res_proj.weight"):
                p.zero_()
            elif name.endswith("_conv1d.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
            elif p.ndim == 1:
                p.fill_(1.0)
            else:
                std = 0.02 * (out_scale if name.endswith(("o_proj.weight", "down_proj.weight", "w2.weight"))
                              else 1.0)
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def windows(tokens: np.ndarray, length: int) -> torch.Tensor:
    n = len(tokens) // length
    return torch.from_numpy(tokens[:n * length].astype(np.int64)).view(n, length)


@torch.no_grad()
def heldout_loss(model: KimiK3ForCausalLM, heldout: torch.Tensor, batch: int, device: str) -> float:
    total, count = 0.0, 0
    for i in range(0, len(heldout), batch):
        ids = heldout[i:i + batch].to(device)
        with torch.autocast("cuda", torch.bfloat16, enabled=device == "cuda"):
            logits = training_logits(model, ids[:, :-1])
        total += F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
        count += ids[:, 1:].numel()
    return total / count


def lr_at(step: int, total: int, warmup: int, peak: float, floor: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def update_router_bias(model: KimiK3ForCausalLM, counts: list[torch.Tensor], rate: float) -> None:
    """Aux-loss-free balancing: experts above the mean load get a lower choice bias, those below a higher one."""
    moes = [layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe")]
    for moe, c in zip(moes, counts, strict=True):
        c = c.float()
        moe.gate.e_score_correction_bias.add_(rate * torch.sign(c.mean() - c))


def save(model: KimiK3ForCausalLM, config: dict, out: Path, tokenizer: Path, log: dict) -> None:
    tensors = {n: checkpoint_layout(n, p.detach().float().cpu(), model.config).contiguous()
               for n, p in model.state_dict().items()}
    size = sum(t.numel() * 4 for t in tensors.values())
    write_checkpoint(out, config, tensors, shards=max(1, math.ceil(size / (15 * 2**20))))
    for f in TOKENIZER_FILES:
        shutil.copy(tokenizer / f, out / f)
    (out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")


def train(args: argparse.Namespace) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    vocab_size = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json")).get_vocab_size()
    config = wrap_k3(default_text_config(vocab_size))
    model = KimiK3ForCausalLM(KimiK3TextConfig.from_dict(config), reference_backends())
    init_weights(model, args.seed)
    model.to(device).train()
    biases = [p for n, p in model.named_parameters() if n.endswith("e_score_correction_bias")]
    for p in biases:
        p.requires_grad_(False)
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                            fused=device == "cuda")
    train_tokens = np.load(args.tokens / "train_tokens.npy")
    heldout = windows(np.load(args.tokens / "heldout_tokens.npy"), args.seq_len + 1)[:args.max_eval_windows]
    gen = torch.Generator().manual_seed(args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "params": n_params,
           "train_tokens": len(train_tokens), "heldout_tokens": heldout[:, 1:].numel(), "args": {
               k: str(v) for k, v in vars(args).items()}, "steps": [], "evals": []}
    print(f"{n_params / 1e6:.2f}M parameters, {len(train_tokens)} training tokens, device {log['device']}")
    total_steps, step, start = args.max_steps, 0, time.perf_counter()
    best = float("inf")
    while step < total_steps:
        starts = torch.randint(0, len(train_tokens) - args.seq_len - 1, (args.batch,), generator=gen).numpy()
        batch = torch.from_numpy(np.stack([train_tokens[s:s + args.seq_len + 1] for s in starts]).astype(np.int64))
        batch = batch.to(device, non_blocking=True)
        lr = lr_at(step, total_steps, args.warmup, args.lr, args.lr * 0.1)
        for group in opt.param_groups:
            group["lr"] = lr
        counts: list[torch.Tensor] = []
        with torch.autocast("cuda", torch.bfloat16, enabled=device == "cuda"):
            logits = training_logits(model, batch[:, :-1], counts)
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            update_router_bias(model, counts, args.bias_update_rate)
        step += 1
        elapsed = time.perf_counter() - start
        if args.time_budget_s and step == args.timing_steps:
            warm_step, warm_time = step, elapsed  # kernels compiled and autotuned by now
        if args.time_budget_s and step == 2 * args.timing_steps:
            # The schedule's length: as many steps as the rest of the budget holds at the measured pace.
            per_step = (elapsed - warm_time) / (step - warm_step) * (1 + 0.5 / args.eval_every)
            total_steps = min(args.max_steps, step + int((args.time_budget_s - elapsed) / per_step))
            log["total_steps"] = total_steps
            print(f"{per_step * 1e3:.0f} ms/step -> {total_steps} steps", flush=True)
        if step % args.log_every == 0 or step == total_steps:
            log["steps"].append({"step": step, "loss": loss.item(), "lr": lr, "grad_norm": grad_norm.item(),
                                 "elapsed_s": elapsed, "tokens": step * args.batch * args.seq_len})
            print(json.dumps(log["steps"][-1]), flush=True)
        if step % args.eval_every == 0 or step == total_steps:
            model.eval()
            held = heldout_loss(model, heldout, args.batch, device)
            model.train()
            log["evals"].append({"step": step, "heldout_loss": held, "heldout_ppl": math.exp(held),
                                 "elapsed_s": time.perf_counter() - start})
            print(json.dumps(log["evals"][-1]), flush=True)
            if held < best:
                best = held
                log["best"] = log["evals"][-1]
                save(model, config, args.out, args.tokenizer, log)
    log["train_time_s"] = time.perf_counter() - start
    (args.out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    return log


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=Path, required=True, help="prepare_corpus output with the token files")
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--time-budget-s", type=float, default=0.0, help="0: run --max-steps")
    ap.add_argument("--timing-steps", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--max-eval-windows", type=int, default=400)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--bias-update-rate", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    train(ap.parse_args(argv))


if __name__ == "__main__":
    main()
