"""The trainer's differentiable forward equals the engine's logits on the same weights, and trains."""
import pytest
import torch
from sequence_runner import SequenceRunner

from vllm.attention.selector import reference_backends
from vllm.model_executor.model_loader import load_model
from vllm.model_executor.models.kimi_k3.model import KimiK3ForCausalLM
from vllm.tools.make_tiny_model import write_tiny_model
from vllm.tools.training_forward import training_logits


@pytest.mark.parametrize("family", ["k3", "kimi_linear"])
def test_training_logits_equal_the_engines(tmp_path, family):
    engine_model = load_model(write_tiny_model(tmp_path / family, family), dtype="float32")
    ids = torch.randint(5, 512, (2, 70), generator=torch.Generator().manual_seed(1))  # > one 64-token chunk
    trainee = KimiK3ForCausalLM(engine_model.config, reference_backends())
    trainee.load_state_dict(engine_model.state_dict())
    counts = []
    got = training_logits(trainee, ids, counts)
    for b in range(2):
        want = SequenceRunner(engine_model).forward_whole(ids[b].tolist())
        torch.testing.assert_close(got[b], want, rtol=1e-4, atol=1e-4)
    moe_layers = sum(hasattr(layer, "block_sparse_moe") for layer in trainee.model.layers)
    assert len(counts) == moe_layers and all(int(c.sum()) == ids.numel() * 2 for c in counts)


def test_a_training_step_lowers_the_loss(tmp_path):
    model = load_model(write_tiny_model(tmp_path / "k3", "k3"), dtype="float32")
    trainee = KimiK3ForCausalLM(model.config, reference_backends())
    trainee.load_state_dict(model.state_dict())
    ids = torch.randint(5, 512, (2, 33), generator=torch.Generator().manual_seed(2))
    opt = torch.optim.Adam(trainee.parameters(), lr=1e-2)

    def loss():
        return torch.nn.functional.cross_entropy(training_logits(trainee, ids[:, :-1]).flatten(0, 1),
                                                 ids[:, 1:].flatten())
    first = loss()
    first.backward()
    no_grad = {n for n, p in trainee.named_parameters() if p.grad is None}
    # The router bias moves by the balancing rule, not the gradient; layer 0's attention input mixes a single
    # source (the embedding), so its AttnRes weights are unused, in the engine as here.
    assert no_grad == {n for n, _ in trainee.named_parameters() if n.endswith("correction_bias")} | {
        "model.layers.0.self_attention_res_norm.weight", "model.layers.0.self_attention_res_proj.weight"}
    opt.step()
    assert loss().item() < first.item()
