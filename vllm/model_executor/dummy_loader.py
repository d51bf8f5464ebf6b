"""`--load-format dummy` (upstream's name): random weights from config.json alone, so a model's real shapes run
(benchmarks, memory planning) with no checkpoint on disk.

Upstream fills every tensor from U(-1e-3, 1e-3). That would make a MoE route every token to the same experts
(router logits all near 0, so the choice falls to the bias), and a decode step of 64 tokens would read 8
experts instead of about 220 of 256: the benchmark would measure a model that does not exist. So the values
follow the shapes' roles instead, as a freshly initialised model's do: projections and embeddings ~ N(0, 0.02)
(transformers' initializer_range), norm gains 1, the router's correction bias 0, A_log = log U(1, 16) (the
decay rates of Mamba-style inits). Tokens then spread over the experts as in a trained model.
"""
from __future__ import annotations

import torch

from vllm.model_executor.models.kimi_k3.model import KimiK3ForCausalLM

INIT_STD = 0.02
_ONES = ("norm.weight", "layernorm.weight")
_ZEROS = ("e_score_correction_bias", "dt_bias")


@torch.no_grad()
def initialize_dummy_weights(model: KimiK3ForCausalLM, seed: int = 0) -> None:
    """Fills every parameter of `model` (storage already on its device) in place, deterministically per seed and
    parameter order, then runs the model's post-load processing as a checkpoint load does."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith(_ONES):
            p.fill_(1.0)
        elif name.endswith(_ZEROS):
            p.zero_()
        elif name.endswith("A_log"):
            p.uniform_(1.0, 16.0, generator=gen).log_()
        else:
            p.normal_(0.0, INIT_STD, generator=gen)
    model.process_weights_after_loading()
