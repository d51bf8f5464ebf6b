"""Cache sizing on CUDA keeps the process's peak reserved memory within --gpu-memory-utilization."""
from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.assets import TINY_TOKENIZER_DIR
from vllm.tools.make_tiny_model import write_tiny_model


@pytest.mark.gpu
@pytest.mark.parametrize("utilization", [0.15, 0.3])
def test_peak_memory_within_gpu_memory_utilization(tmp_path, utilization):
    # A 1M-token context makes the memory budget, not max_num_seqs * max_model_len, bound the block count.
    path = write_tiny_model(tmp_path / "m", "k3", max_position_embeddings=1 << 20)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    llm = LLM(model=path, tokenizer=str(TINY_TOKENIZER_DIR), device="cuda", gpu_memory_utilization=utilization,
              max_num_batched_tokens=4096)
    layout = llm.llm_engine.runner.layout
    llm.generate([{"prompt_token_ids": [5 + i % 200 for i in range(3000)]}] * 4, SamplingParams(max_tokens=8),
                 use_tqdm=False)
    total = torch.cuda.get_device_properties(0).total_memory
    peak = torch.cuda.max_memory_reserved()
    print(f"utilization {utilization}: {layout.num_blocks} blocks, {layout.num_state_slots} slots, "
          f"budget {layout.budget_bytes / 2**30:.2f} GiB, peak reserved {peak / 2**30:.2f} GiB "
          f"of {utilization * total / 2**30:.2f} GiB allowed")
    assert layout.budget_bytes > 0.5 * utilization * total  # the cache really took the budget
    assert peak <= utilization * total
    llm.llm_engine.kv_cache_manager.assert_all_free()
    del llm
    torch.cuda.empty_cache()
