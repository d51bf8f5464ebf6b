"""The DSpark trainer (vllm.tools.train_dspark) on the CPU: its block forward equals the engine's draft forward,
its losses train every part (the context path's layer weights through their stacked copy included), and what it
saves loads as a draft the engine runs."""
from __future__ import annotations

import numpy as np
import torch
from code_prompts import heldout_code_ids

from vllm import LLM, SamplingParams
from vllm.assets import DEFAULT_MODEL_DIR
from vllm.model_executor.dspark_loader import load_dspark_draft
from vllm.model_executor.model_loader import load_config, load_model
from vllm.model_executor.models.dspark.model import DSparkDraftModel
from vllm.tools import train_dspark
from vllm.tools.make_dspark_draft import dspark_config_for, random_draft_state_dict
from vllm.transformers_utils.configs.dspark import DSparkConfig
from vllm.transformers_utils.tokenizer import get_tokenizer


def target_tokenizer():
    return get_tokenizer(DEFAULT_MODEL_DIR)


def _draft(seed=0):
    config = dspark_config_for(DEFAULT_MODEL_DIR)
    draft = DSparkDraftModel(DSparkConfig.from_json_dict(config, "test"))
    draft.load_state_dict(random_draft_state_dict(config, seed))
    draft.process_weights_after_loading()
    return draft, config


def test_block_forward_equals_the_engine_draft_on_the_same_context():
    """The trainer's all-anchors-at-once forward gives, for each anchor, the logits the engine's propose path
    computes from a paged cache (first block position: its Markov bias is the anchor's in both)."""
    target = load_model(DEFAULT_MODEL_DIR, "float32")
    draft, _ = _draft()
    tokens = torch.tensor(heldout_code_ids(target_tokenizer(), [40]))
    hidden, _ = train_dspark.target_features(target, tokens, draft.config.target_layer_ids)
    anchors = torch.tensor([0, 9, 30])
    K = 4
    with torch.no_grad():
        logits, _, _ = train_dspark.block_forward(draft, target, tokens, hidden, anchors, K)
        bs = 8
        draft.bind_caches([torch.zeros(8, bs, draft.config.mla_cache_dim) for _ in draft.layers])
        pos = torch.arange(40)
        draft.write_context(hidden[0], pos, pos)  # blocks 0..4 in order
        h = draft.backbone(draft.block_inputs(tokens[0, anchors], K, target.model.embed_tokens),
                           anchors[:, None] + torch.arange(K), [
                               layer.self_attn.kv_cache.view(-1, draft.config.mla_cache_dim)[pos.expand(3, -1)]
                               for layer in draft.layers],
                           torch.cat([pos[None, None, :].expand(3, K, -1) < anchors[:, None, None],
                                      torch.ones(3, K, K, dtype=torch.bool)], dim=-1))
        engine_first = draft.markov_logits(h[:, 0] @ target.lm_head.weight.t(), tokens[0, anchors])
    torch.testing.assert_close(logits[0, :, 0], engine_first, rtol=1e-4, atol=1e-4)


def test_training_lowers_the_losses_and_reaches_every_weight():
    torch.manual_seed(0)
    target = load_model(DEFAULT_MODEL_DIR, "float32")
    draft, _ = _draft(seed=1)
    batch = torch.tensor(heldout_code_ids(target_tokenizer(), [65, 65]))
    anchors = torch.tensor([2, 17, 33, 50])
    before = {n: p.detach().clone() for n, p in draft.named_parameters()}
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    first = None
    for _ in range(8):
        draft.process_weights_after_loading()
        out = train_dspark.losses(draft, target, batch, anchors, 4, 1.0)
        first = first if first is not None else out["ce"].item()
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
    draft.process_weights_after_loading()
    out = train_dspark.losses(draft, target, batch, anchors, 4, 1.0)
    # (The BCE's target moves with q, so only the cross-entropy must fall; the confidence head must learn.)
    assert out["ce"].item() < first - 0.1
    assert ((out["accept"] >= 0) & (out["accept"] <= 1 + 1e-6)).all()
    unchanged = [n for n, p in draft.named_parameters() if torch.equal(p, before[n])]
    assert not unchanged, unchanged


def test_the_trainer_writes_a_draft_the_engine_runs(tmp_path):
    tokens = np.array(sum(heldout_code_ids(target_tokenizer(), [300, 200]), []), dtype=np.uint16)
    np.save(tmp_path / "train_tokens.npy", tokens[:300])
    np.save(tmp_path / "heldout_tokens.npy", tokens[300:])
    out = tmp_path / "draft"
    log = train_dspark.train(train_dspark.build_parser().parse_args([
        "--tokens", str(tmp_path), "--out", str(out), "--seq-len", "48", "--batch", "2", "--anchors", "6",
        "--num-speculative-tokens", "3", "--max-steps", "3", "--warmup", "1", "--max-eval-windows", "2"]))
    held = log["heldout"]
    assert len(held["acceptance_per_pos"]) == len(held["confidence_per_pos"]) == 3 and held["calibration"]
    draft = load_dspark_draft(out, load_config(DEFAULT_MODEL_DIR), torch.float32, "cpu")
    assert draft.confidence_head.weight.dtype == torch.float32
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = LLM(dtype="float32", max_model_len=128).generate(["def f(x):\n"], params, use_tqdm=False)
    got = LLM(dtype="float32", max_model_len=128, speculative_config={
        "method": "dspark", "model": str(out), "num_speculative_tokens": 3}).generate(["def f(x):\n"], params,
                                                                                      use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
