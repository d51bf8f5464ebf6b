"""benchmarks/bench_real_shape.py's bytes floor: the figure its percentages are taken against (CPU, meta tensors)."""
from __future__ import annotations

import json
import sys

import pytest
import torch
from benchmark_scripts import BENCHMARKS, load

from vllm.transformers_utils.configs.kimi_k3 import KimiK3TextConfig

sys.path.insert(0, str(BENCHMARKS))
bench = load("bench_real_shape")
CONFIG = KimiK3TextConfig.from_dict(json.loads((BENCHMARKS / "configs" / "kimi-linear-48b-a3b.json").read_text()))
WEIGHTS = bench.weight_bytes(CONFIG, torch.bfloat16)


def test_48b_config_is_the_published_shape():
    c = CONFIG
    assert (c.num_hidden_layers, len(c.kda_layers), len(c.mla_layers)) == (27, 20, 7)
    assert (c.hidden_size, c.kda_num_heads, c.num_experts, c.num_experts_per_token, c.moe_intermediate_size,
            c.vocab_size) == (2304, 32, 256, 8, 1024, 163840)


@pytest.mark.parametrize("state_bytes", [2, 4])
def test_floor_counts_each_part_once(state_bytes):
    one = bench.floor_bytes(CONFIG, WEIGHTS, 1, 1000, state_bytes)
    expert_bytes = 3 * 2304 * 1024 * 2
    moe_layers = 26
    assert one["experts_touched_per_layer"] == pytest.approx(8)
    assert one["experts"] == pytest.approx(8 * moe_layers * expert_bytes)
    assert one["kda_state"] == 20 * (2 * 32 * 128 * 128 * state_bytes + 2 * 3 * 4096 * 3 * 2)
    assert one["mla_cache"] == 7 * 1001 * 576 * 2
    assert one["total"] == pytest.approx(one["dense_weights"] + one["experts"] + one["kda_state"] + one["mla_cache"])
    # all but the routed experts and the unread embedding rows: attention, shared experts, layer 0's MLP, lm_head
    assert 3.0e9 < one["dense_weights"] < 3.6e9
    big = bench.floor_bytes(CONFIG, WEIGHTS, 4096, 1000, state_bytes)
    assert 255 < big["experts_touched_per_layer"] <= 256, "a big batch touches every expert"
    assert big["dense_weights"] - one["dense_weights"] == 4095 * 2304 * 2, "embedding rows read per request"
