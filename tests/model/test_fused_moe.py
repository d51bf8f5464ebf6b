"""The fused MoE (layers/fused_moe) against torch references: on CPU through the Triton interpreter, on CUDA for real.

The reference is a float64 loop over every (token, chosen expert) pair; bf16 runs are held to the error that
the torch bf16 expert loop (KimiMoE._routed_by_expert) makes against the same reference, so the tolerance is
the dtype's, not a guess. Routings are fresh random top-k draws, plus the degenerate ones (every pair on one
expert, one token, no token).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from vllm.model_executor.layers.fused_moe import MoEActivation, fused_experts, grouped_topk, moe_align_block_size
from vllm.model_executor.layers.fused_moe.fused_moe import (GemmConfig, pick_config, pipelined_smem_bytes,
                                                            up_b_tiles)
from vllm.model_executor.layers.fused_moe.tile_configs import (CONFIG_DIR, config_file_name, load_table,
                                                               table_to_json, tuned_config)
from vllm.model_executor.models.kimi_k3 import moe as moe_module
from vllm.model_executor.models.kimi_k3.moe import KimiMoE, KimiRouter
from vllm.tools.make_tiny_model import tiny_text_config
from vllm.transformers_utils.configs.kimi_k3 import KimiK3TextConfig

DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                        reason="CPU tensors run through the Triton interpreter")),
           pytest.param("cuda", marks=pytest.mark.gpu)]
ACTIVATIONS = [MoEActivation("silu"), MoEActivation("situ", 4.0, 25.0)]


def random_routing(T: int, E: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]) if T else torch.empty(0, k)
    return torch.rand(T, k, generator=gen), ids.long()


def reference(x, w13, w2, weights, ids, act: MoEActivation) -> torch.Tensor:
    x, w13, w2, weights = (t.double().cpu() for t in (x, w13, w2, weights))
    inter = w13.shape[1] // 2
    y = torch.zeros(x.shape, dtype=torch.float64)
    for t, j in torch.cartesian_prod(torch.arange(ids.shape[0]), torch.arange(ids.shape[1])).tolist():
        e = int(ids[t, j])
        g, u = (w13[e] @ x[t]).split(inter)
        if act.name == "situ":
            a = (act.situ_beta * torch.tanh(g / act.situ_beta) * torch.sigmoid(g)
                 * act.situ_linear_beta * torch.tanh(u / act.situ_linear_beta))
        else:
            a = torch.nn.functional.silu(g) * u
        y[t] += weights[t, j] * (w2[e] @ a)
    return y


def make_experts(E, D, inter, dtype, device, gen):
    w13 = (0.3 * torch.randn(E, 2 * inter, D, generator=gen)).to(device=device, dtype=dtype)
    w2 = (0.3 * torch.randn(E, D, inter, generator=gen)).to(device=device, dtype=dtype)
    return w13, w2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,E,k,block_m", [(1, 8, 2, 16), (7, 8, 8, 16), (37, 16, 3, 16), (300, 8, 2, 64),
                                           (5, 512, 6, 16), (64, 4, 1, 32)])
def test_align_groups_every_pair_once_by_expert(device, T, E, k, block_m):
    gen = torch.Generator().manual_seed(T * 1000 + E)
    _, ids = random_routing(T, E, k, gen)
    sorted_pairs, block_expert, num_padded = moe_align_block_size(ids.to(device, torch.int32), block_m, E)
    sorted_pairs, block_expert = sorted_pairs.cpu(), block_expert.cpu()
    flat, n = ids.flatten(), T * k
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + block_m - 1) // block_m * block_m
    assert int(num_padded.item()) == int(padded.sum()), "rows in use are each expert's count, padded to a block"
    assert block_expert.numel() * block_m >= int(padded.sum()), "the grid bound covers this routing"
    used = sorted_pairs[:int(padded.sum())]
    start = 0
    for e in range(E):
        run = used[start:start + int(padded[e])]
        real = run[:int(counts[e])]
        assert real.tolist() == (flat == e).nonzero().flatten().tolist(), f"expert {e}'s pairs, in pair order"
        assert (run[int(counts[e]):] == n).all(), "an expert's padding rows hold the no-pair sentinel"
        assert (block_expert[start // block_m:(start + int(padded[e])) // block_m] == e).all()
        start += int(padded[e])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ACTIVATIONS, ids=lambda a: a.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T,E,k", [(1, 8, 1), (5, 8, 2), (40, 16, 4), (3, 512, 8), (300, 8, 2), (70, 8, 8)])
def test_fused_experts_match_the_reference(device, act, dtype, T, E, k):
    """Covers every tile family of pick_config: decode-sized (<= 16 pairs per expert), mid and prefill-sized."""
    gen = torch.Generator().manual_seed(T + 7 * E + k)
    D, inter = (64, 32) if device == "cpu" else (2048, 704)
    x = torch.randn(T, D, generator=gen).to(device=device, dtype=dtype)
    w13, w2 = make_experts(E, D, inter, dtype, device, gen)
    weights, ids = random_routing(T, E, k, gen)
    y = fused_experts(x, w13, w2, weights.to(device), ids.to(device), act)
    assert y.dtype == torch.float32 and y.shape == (T, D)
    ref = reference(x, w13, w2, weights, ids, act)
    err = (y.double().cpu() - ref).abs().max().item()
    if dtype == torch.float32:
        assert err <= 1e-4 * max(1.0, ref.abs().max().item()), err
    else:
        loop = KimiMoE(KimiK3TextConfig.from_dict({**tiny_text_config("kimi_linear"), "hidden_size": D,
                                                   "moe_intermediate_size": inter, "num_experts": E,
                                                   "num_experts_per_token": k, "hidden_act": act.name,
                                                   "num_shared_experts": 0})).to(device=device, dtype=dtype)
        for i, expert in enumerate(loop.experts):
            expert.w1.weight.data, expert.w3.weight.data = w13[i].split(inter)
            expert.w2.weight.data = w2[i]
        torch_err = (loop._routed_by_expert(x, weights.to(device), ids.to(device)).double().cpu() - ref).abs().max()
        # The interpreter's fp32 -> bf16 casts truncate (GPUs round to nearest even), a biased error the kernels
        # make twice per pair (activation, expert output): 1.4-3.5x torch's error here on the CPU.
        factor = 4 if device == "cpu" else 2
        assert err <= factor * torch_err.item() + 1e-3, (err, torch_err.item())
    assert ref.abs().min() > 0, "every token's output is non-zero: the check compares real values"


@pytest.mark.parametrize("device", DEVICES)
def test_degenerate_routings(device):
    gen = torch.Generator().manual_seed(3)
    D, inter, E = 32, 16, 8
    w13, w2 = make_experts(E, D, inter, torch.float32, device, gen)
    x = torch.randn(9, D, generator=gen).to(device)
    weights = torch.rand(9, 2, generator=gen)
    same = torch.tensor([[5, 2]] * 9)  # every token on the same two experts: one expert's run spans blocks
    y = fused_experts(x, w13, w2, weights.to(device), same.to(device), ACTIVATIONS[0])
    torch.testing.assert_close(y.double().cpu(), reference(x, w13, w2, weights, same, ACTIVATIONS[0]),
                               rtol=1e-4, atol=1e-4)
    empty = fused_experts(x[:0], w13, w2, weights[:0].to(device), same[:0].to(device), ACTIVATIONS[0])
    assert empty.shape == (0, D)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split_act", [False, True])
def test_expert_map_skips_other_ranks_experts(device, split_act):
    """Expert parallelism: this rank holds global experts [4, 12) of 16; a choice of another rank's expert adds
    nothing, in the fused kernels (the unfused gate/up too, which leaves such rows unwritten) and in the torch
    loop alike (and is not computed on a stand-in expert)."""
    gen = torch.Generator().manual_seed(11)
    D, inter, E, local, start, T, k = 32, 16, 16, 8, 4, 23, 4
    w13, w2 = make_experts(local, D, inter, torch.float32, device, gen)
    x = torch.randn(T, D, generator=gen).to(device)
    weights, ids = random_routing(T, E, k, gen)
    expert_map = torch.full((E,), -1, dtype=torch.int32)
    expert_map[start:start + local] = torch.arange(local, dtype=torch.int32)
    mine = (ids >= start) & (ids < start + local)
    assert mine.any() and not mine.all()
    ref = reference(x, w13, w2, weights * mine, (ids - start).clamp(0, local - 1), ACTIVATIONS[0])
    tiles = (GemmConfig(16, 32, 32, 4, 2, split_act=True), GemmConfig(16, 32, 32, 4, 2)) if split_act else None
    y = fused_experts(x, w13, w2, weights.to(device), ids.to(device), ACTIVATIONS[0], expert_map=expert_map.to(device),
                      tiles=tiles)
    torch.testing.assert_close(y.double().cpu(), ref, rtol=1e-4, atol=1e-4)
    if split_act:
        return
    sorted_pairs, _, num_padded = moe_align_block_size(expert_map[ids].to(device), 16, local)
    used = sorted_pairs[:int(num_padded.item())].cpu()
    assert set(used[used < T * k].tolist()) == set(mine.flatten().nonzero().flatten().tolist())
    loop = KimiMoE(KimiK3TextConfig.from_dict({**tiny_text_config("kimi_linear"), "hidden_size": D,
                                               "moe_intermediate_size": inter, "num_experts": local,
                                               "num_shared_experts": 0})).to(device)
    for i, expert in enumerate(loop.experts):
        expert.w1.weight.data, expert.w3.weight.data = w13[i].split(inter)
        expert.w2.weight.data = w2[i]
    loop.expert_map = expert_map.to(device)
    torch.testing.assert_close(loop._routed_by_expert(x, weights.to(device), ids.to(device)).double().cpu(), ref,
                               rtol=1e-4, atol=1e-4)


def test_unsupported_dtype_is_refused_by_name():
    x = torch.randn(2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="float64"):
        fused_experts(x, torch.randn(4, 8, 8, dtype=torch.float64), torch.randn(4, 8, 4, dtype=torch.float64),
                      torch.rand(2, 1), torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="'gelu'"):
        MoEActivation("gelu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,groups", [("k3", 1), ("k3", 2), ("kimi_linear", 1)])
def test_moe_layer_takes_the_fused_path_and_matches_the_expert_loop(device, kind, groups, monkeypatch):
    """The whole block (router, grouped top-k, K3's latent MoE and its norm, shared experts) through the fused
    kernels equals it through the torch expert loop."""
    torch.manual_seed(groups)
    cfg = tiny_text_config(kind)
    if groups > 1:
        cfg.update(num_expert_group=groups, topk_group=1)
    moe = KimiMoE(KimiK3TextConfig.from_dict(cfg)).to(device)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    moe.process_weights_after_loading()
    assert moe.experts[1].w3.weight.data_ptr() == moe.w13[1, moe.w13.shape[1] // 2:].data_ptr(), \
        "the experts' parameters are views into the stacked weights, not copies"
    x = torch.randn(11, cfg["hidden_size"], device=device)
    _, ids = moe.gate(x)
    assert len(set(ids.flatten().tolist())) > 1, "the routing spreads over several experts"
    if groups > 1:
        per_group = cfg["num_experts"] // groups
        assert all(len({e // per_group for e in row}) == 1 for row in ids.tolist()), "topk_group=1 keeps one group"
    calls = []
    fused = moe._routed_fused
    monkeypatch.setattr(moe, "_routed_fused", lambda *a: calls.append(1) or fused(*a))
    monkeypatch.setattr(moe_module, "capturing_graph", lambda t: True)  # as under capture: CPU takes the kernels
    y_fused = moe(x)
    monkeypatch.undo()
    # The reference: the same forward on the torch path (router, expert loop, shared experts apart; on CUDA too).
    monkeypatch.setattr(moe_module, "fused_moe_unsupported", lambda t: "the torch reference")
    y_ref = moe(x)
    assert calls == [1], "the fused kernels ran"
    torch.testing.assert_close(y_fused, y_ref, rtol=1e-4, atol=1e-4)
    if moe.shared_in_experts:  # Kimi-Linear: its one shared expert runs in the fused kernels, as expert E
        assert moe.w13.shape[0] == len(moe.experts) + 1
        assert moe.shared_experts.down_proj.weight.data_ptr() == moe.w2[-1].data_ptr()
        assert moe.shared_experts.gate_up_weight.data_ptr() == moe.w13[-1].data_ptr()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("E,k,groups,topk_group,renormalize,scale", [
    (8, 1, 1, 1, True, 1.0), (32, 4, 1, 1, True, 2.5), (64, 8, 8, 4, True, 1.0), (64, 6, 8, 2, False, 1.0),
    (384, 8, 1, 1, True, 2.827), (256, 16, 8, 4, True, 1.0), (16, 3, 16, 4, True, 1.0)])
def test_grouped_topk_matches_the_router(device, E, k, groups, topk_group, renormalize, scale):
    """The one-launch routing choice equals KimiRouter's torch form on fresh random logits and biases: the same
    experts in the same order and the same weights (groups of one expert included)."""
    gen = torch.Generator().manual_seed(E * k + groups)
    cfg = {**tiny_text_config("k3"), "num_experts": E, "num_experts_per_token": k, "num_expert_group": groups,
           "topk_group": topk_group, "moe_renormalize": renormalize, "routed_scaling_factor": scale}
    router = KimiRouter(KimiK3TextConfig.from_dict(cfg))
    router.e_score_correction_bias.data = 0.1 * torch.randn(E, generator=gen)
    logits = 2 * torch.randn(33, E, generator=gen)
    want_w, want_ids = router.forward_native(logits)
    got_w, got_ids = grouped_topk(logits.to(device), router.e_score_correction_bias.to(device), k, groups,
                                  topk_group, renormalize, scale)
    assert got_ids.dtype == torch.int32
    assert torch.equal(got_ids.cpu().long(), want_ids)
    torch.testing.assert_close(got_w.cpu(), want_w, rtol=1e-6, atol=1e-7)
    # with_shared: the same choice, then expert E with weight 1 in one more column
    sw, sids = grouped_topk(logits.to(device), router.e_score_correction_bias.to(device), k, groups, topk_group,
                            renormalize, scale, with_shared=True)
    assert torch.equal(sids[:, :k], got_ids) and torch.equal(sw[:, :k], got_w)
    assert (sids[:, k] == E).all() and (sw[:, k] == 1.0).all()


def test_grouped_topk_refuses_impossible_choices():
    with pytest.raises(ValueError, match="cannot give top_k=5"):
        grouped_topk(torch.zeros(2, 8), torch.zeros(8), 5, num_groups=4, topk_group=2)
    with pytest.raises(ValueError, match="float32"):
        grouped_topk(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(8), 2)


@pytest.mark.parametrize("elem_size", [2, 4])
@pytest.mark.parametrize("smem", [232_448, 166_912, 101_376], ids=["H100/H200", "A100", "sm86"])
@pytest.mark.parametrize("num_pairs", [1, 100, 400, 8192])
def test_picked_tiles_fit_the_devices_shared_memory(elem_size, smem, num_pairs):
    up, down = pick_config(num_pairs, 8, 704, 2048, 132, elem_size, smem)
    assert pipelined_smem_bytes(up, 2, elem_size) <= smem
    assert pipelined_smem_bytes(down, 1, elem_size) <= smem
    assert min(up.num_stages, down.num_stages) >= 2


def test_tiles_that_fit_are_kept_as_tuned():
    """The H200-tuned 2-byte tiles fit there as they are; the float32 prefill ones lose a stage."""
    bf16 = pick_config(8192, 8, 704, 2048, 132, 2, 232_448)
    assert [c.num_stages for c in bf16] == [4, 4] and bf16[0].block_k == 64
    fp32 = pick_config(8192, 8, 704, 2048, 132, 4, 232_448)
    assert pipelined_smem_bytes(GemmConfig(128, 128, 64, 8, 4), 2, 4) == 294_912 > 232_448
    assert [c.num_stages for c in fp32] == [3, 3] and fp32[0].block_m == bf16[0].block_m


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiles,act", [
    ((GemmConfig(16, 16, 32, 4, 2), GemmConfig(16, 32, 16, 4, 3)), ACTIVATIONS[0]),
    ((GemmConfig(32, 32, 16, 4, 2), GemmConfig(32, 16, 32, 4, 2)), ACTIVATIONS[0]),
    ((GemmConfig(16, 32, 32, 4, 2, split_act=True), GemmConfig(16, 32, 16, 4, 3)), ACTIVATIONS[0]),
    ((GemmConfig(32, 64, 16, 4, 2, split_act=True), GemmConfig(32, 16, 32, 4, 2)), ACTIVATIONS[1])],
    ids=["bm16", "bm32", "bm16-split_act", "bm32-split_act-situ"])
def test_explicit_tiles_give_the_same_experts(device, tiles, act):
    """The tuner times candidate tiles through `tiles=`: every candidate, the unfused gate/up (split_act) among
    them, must compute the same function."""
    gen = torch.Generator().manual_seed(11)
    D, inter, E, T, k = 64, 48, 8, 21, 3  # neither width a multiple of every tile: the masks are exercised
    w13, w2 = make_experts(E, D, inter, torch.float32, device, gen)
    x = torch.randn(T, D, generator=gen).to(device)
    weights, ids = random_routing(T, E, k, gen)
    y = fused_experts(x, w13, w2, weights.to(device), ids.to(device), act, tiles=tiles)
    torch.testing.assert_close(y.double().cpu(), reference(x, w13, w2, weights, ids, act), rtol=1e-4, atol=1e-4)


def _write_table(directory, name, table):
    (directory / name).write_text(json.dumps(table_to_json(table)))
    load_table.cache_clear()


def test_tuned_table_gives_the_nearest_token_count(tmp_path):
    name = config_file_name(256, 1024, 2304, "cpu", torch.bfloat16)
    assert name == "E256-N1024-K2304-cpu-bf16.json"
    small, big = (GemmConfig(16, 32, 128, 4, 4), GemmConfig(16, 64, 128, 4, 4)), \
        (GemmConfig(128, 128, 64, 8, 3), GemmConfig(128, 256, 64, 8, 3))
    _write_table(tmp_path, name, {16: small, 4096: big})
    cpu = torch.device("cpu")
    pick = lambda t: tuned_config(t, 256, 1024, 2304, torch.bfloat16, cpu, tmp_path)  # noqa: E731
    assert pick(1) == small and pick(2055) == small and pick(2057) == big and pick(100_000) == big
    assert tuned_config(16, 256, 1024, 2304, torch.float16, cpu, tmp_path) is None, "another dtype has no table"
    assert tuned_config(16, 128, 1024, 2304, torch.bfloat16, cpu, tmp_path) is None, "another shape has none"


def test_malformed_tile_tables_are_refused_by_name(tmp_path):
    name = config_file_name(8, 32, 64, "cpu", torch.float32)
    (tmp_path / name).write_text('{"16": {"up": {"block_m": 16}}}')
    load_table.cache_clear()
    with pytest.raises(ValueError, match=f"{name}.*malformed"):
        tuned_config(16, 8, 32, 64, torch.float32, torch.device("cpu"), tmp_path)
    _write_table(tmp_path, name, {16: (GemmConfig(16, 32, 64, 4, 3), GemmConfig(32, 32, 64, 4, 3))})
    with pytest.raises(ValueError, match="share block_m"):
        tuned_config(16, 8, 32, 64, torch.float32, torch.device("cpu"), tmp_path)
    _write_table(tmp_path, name, {16: (GemmConfig(16, 32, 64, 4, 3), GemmConfig(16, 32, 64, 4, 3, split_act=True))})
    with pytest.raises(ValueError, match="split_act applies to the up tiles only"):
        tuned_config(16, 8, 32, 64, torch.float32, torch.device("cpu"), tmp_path)


def test_shipped_tile_tables_parse_and_fit_hopper():
    """Every table in the package loads, and its tiles fit an H100/H200's shared memory as they are."""
    files = sorted(CONFIG_DIR.glob("*.json"))
    for f in files:
        load_table.cache_clear()
        table = load_table(f.name)
        elem = 4 if "dtype=fp32" in f.name else 2
        for up, down in table.values():
            assert pipelined_smem_bytes(up, up_b_tiles(up), elem) <= 232_448
            assert pipelined_smem_bytes(down, 1, elem) <= 232_448
