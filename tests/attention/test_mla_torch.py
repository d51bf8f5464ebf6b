"""The absorbed (latent-space MQA) and unabsorbed (expanded K/V) MLA forms agree over a paged cache."""
from __future__ import annotations

import torch

from vllm.attention.backend import CommonAttentionMetadata
from vllm.attention.mla.torch_ref import TorchMLABackend


def test_absorbed_equals_unabsorbed_on_ragged_rows():
    gen = torch.Generator().manual_seed(0)
    H, nope, rope, v, L, bs = 4, 16, 8, 12, 32, 4
    # A fresh prompt, a decode row, a 4-token verify-style row, another decode row (batched with the first).
    ctx, qlens = [0, 9, 30, 17], [5, 1, 4, 1]
    seq_lens = [c + q for c, q in zip(ctx, qlens)]
    num_blocks = 40
    kv_cache = torch.randn(num_blocks, bs, L + rope, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)  # scattered blocks
    block_table = torch.zeros(4, 10, dtype=torch.int32)
    slot_mapping = []
    used = 0
    for r, n in enumerate(seq_lens):
        nb = -(-n // bs)
        block_table[r, :nb] = perm[used:used + nb].int()
        used += nb
        slot_mapping += [int(block_table[r, p // bs]) * bs + p % bs for p in range(ctx[r], n)]
    T = sum(qlens)
    qsl = torch.tensor([0, 5, 6, 10, 11], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32), num_reqs=4, num_actual_tokens=T, max_query_len=5,
        max_seq_len=max(seq_lens), block_table=block_table, slot_mapping=torch.tensor(slot_mapping),
        is_prefilling=torch.tensor([True, False, False, False]), state_indices=torch.zeros(4, dtype=torch.int32),
        state_indices_cpu=torch.zeros(4, dtype=torch.int32))
    q = torch.randn(T, H, nope + rope, generator=gen)
    latent = torch.randn(T, L + rope, generator=gen)
    w_kvb = torch.randn(H * (nope + v), L, generator=gen) * L ** -0.5
    outs = []
    for absorbed in (True, False):
        meta = TorchMLABackend.builder(bs).build(common)
        meta.force_absorbed = absorbed
        cache = kv_cache.clone()
        outs.append(TorchMLABackend.forward(q, latent, cache, w_kvb, nope, v, (nope + rope) ** -0.5, meta))
        rows = cache.view(-1, L + rope)
        torch.testing.assert_close(rows[torch.tensor(slot_mapping)], latent)  # new rows were written
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    # Causality: the first prompt token sees only itself, so its output is exactly its own value row.
    w = w_kvb.view(H, nope + v, L)
    torch.testing.assert_close(outs[0][0], torch.einsum("l,hvl->hv", latent[0, :L], w[:, nope:]),
                               rtol=1e-5, atol=1e-5)
