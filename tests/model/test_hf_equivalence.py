"""Our model's logits equal transformers' KimiLinearForCausalLM on tiny random checkpoints (fp32, CPU).

Each configuration is written with transformers' save_pretrained and read back by our loader, so the
test covers the checkpoint names and layouts as well as the math. The oracle is transformers' torch code on
the CPU, whatever device our model runs on.
"""
from __future__ import annotations

import pytest
import torch
from hf_oracle import BASE, perturbed_hf_model, save_for_us
from sequence_runner import SeqChunk, SequenceRunner

from vllm.model_executor.model_loader import load_model

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


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(name, device, tmp_path):
    hf = perturbed_hf_model({**BASE, **CONFIGS[name]}, seed=len(name))
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
    hf = perturbed_hf_model({**BASE, **CONFIGS["q_lora_groups"]}, seed=7)
    ours = load_model(save_for_us(hf, tmp_path / "m"), "float32", device)
    prompt = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    got = SequenceRunner(ours, max_model_len=64).generate_greedy([prompt], max_tokens=12)[0]
    assert got == ref
