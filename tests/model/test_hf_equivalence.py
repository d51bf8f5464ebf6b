"""Our model's logits equal transformers' KimiLinearForCausalLM on tiny random checkpoints (fp32, CPU).

Each configuration is written with transformers' save_pretrained and read back by our loader, so the
test covers the checkpoint names and layouts as well as the math. The oracle is transformers' torch code on
the CPU, whatever device our model runs on.
"""
from __future__ import annotations

import importlib
import json
import sys

import pytest
import torch

from vllm.model_executor.model_loader import load_model
from vllm.model_executor.sequence_runner import SeqChunk, SequenceRunner


def import_torch_only_oracle():
    """transformers picks fla-core's Triton kernels when fla is importable (decided at import time); those
    run only on CUDA and in TF32. Import the modeling file with fla hidden so the oracle is plain torch."""
    name = "transformers.models.kimi_linear.modeling_kimi_linear"
    if name not in sys.modules:
        saved = sys.modules.get("fla")
        sys.modules["fla"] = None  # makes `import fla` raise ImportError
        try:
            importlib.import_module(name)
        finally:
            if saved is None:
                del sys.modules["fla"]
            else:
                sys.modules["fla"] = saved
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    return KimiLinearConfig, KimiLinearForCausalLM


KimiLinearConfig, KimiLinearForCausalLM = import_torch_only_oracle()

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, num_local_experts=8, num_experts_per_tok=2, routed_scaling_factor=1.0,
            hidden_act="silu", rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

CONFIGS = {
    # Kimi's own 3:1 pattern, plain q_proj, one shared expert, one group.
    "no_q_lora": dict(num_hidden_layers=4, q_lora_rank=None, n_shared_experts=1, n_group=1, topk_group=1,
                      first_k_dense_replace=1,
                      linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [4], "head_dim": 16,
                                          "num_heads": 4, "short_conv_kernel_size": 4}),
    # q_lora path, MLA in the middle, no shared experts (transformers writes 0-width ones), two groups.
    "q_lora_groups": dict(num_hidden_layers=4, q_lora_rank=32, n_shared_experts=0, n_group=2, topk_group=1,
                          first_k_dense_replace=1,
                          linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3], "head_dim": 16,
                                              "num_heads": 4, "short_conv_kernel_size": 4}),
    # MLA first, two dense layers, four groups of which two are kept, two shared experts, 8 KDA heads of 8.
    "mla_first_4_groups": dict(num_hidden_layers=5, q_lora_rank=16, n_shared_experts=2, n_group=4, topk_group=2,
                               first_k_dense_replace=2, routed_scaling_factor=2.5,
                               linear_attn_config={"kda_layers": [2, 3, 5], "full_attn_layers": [1, 4],
                                                   "head_dim": 8, "num_heads": 8, "short_conv_kernel_size": 4}),
}


def perturbed_hf_model(overrides: dict, seed: int) -> KimiLinearForCausalLM:
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(KimiLinearConfig(**{**BASE, **overrides})).eval()
    with torch.no_grad():  # move everything the init leaves at a round value away from it
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "A_log", "dt_bias")):
                p.add_(0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(0.1 * torch.randn_like(b))
    return model


def save_for_us(model: KimiLinearForCausalLM, path) -> str:
    model.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    # transformers hard-codes eps 1e-6 in q_a/kv_a_layernorm; tell our config so.
    config["mla_latent_norm_eps"] = 1e-6
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(name, device, tmp_path):
    hf = perturbed_hf_model(CONFIGS[name], seed=len(name))
    ours = load_model(save_for_us(hf, tmp_path / name), "float32", device)
    runner = SequenceRunner(ours, max_seqs=4, max_model_len=256)
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (1, 37, 150)]
    # All prompts in one flat batch, as the engine runs them.
    for i in range(len(prompts)):
        runner.add(i)
    got = runner.step([SeqChunk(i, p, prefill=True) for i, p in enumerate(prompts)], all_logits=True)
    for prompt, logits in zip(prompts, got):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        assert rel_err(logits.cpu(), ref) <= 1e-4, name


@pytest.mark.parametrize("device", DEVICES)
def test_decode_matches_transformers_generate(device, tmp_path):
    """Greedy continuation through the carried KDA state and latent cache equals transformers' generate."""
    hf = perturbed_hf_model(CONFIGS["q_lora_groups"], seed=7)
    ours = load_model(save_for_us(hf, tmp_path / "m"), "float32", device)
    prompt = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    got = SequenceRunner(ours, max_model_len=64).generate_greedy([prompt], max_tokens=12)[0]
    assert got == ref
