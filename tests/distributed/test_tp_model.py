"""The model split over 2 tensor-parallel ranks (gloo, CPU processes), its MoE layers split by expert width or
(expert parallelism) by expert, against the same model on one: logits of a
whole prompt, and greedy continuations of a batch with chunked prompts, on the built-in model (K3's features:
latent MoE, block AttnRes, MLA output gate) and a Kimi-Linear-shaped tiny checkpoint. Each rank reads its own
slices of the checkpoint."""
from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp
from sequence_runner import SequenceRunner

from vllm.assets import DEFAULT_MODEL_DIR
from vllm.model_executor.model_loader import load_model

PROMPTS = [[5, 17, 301, 42, 7, 99, 1024, 3, 64, 12], [200, 201, 202], list(range(30, 75))]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(model_dir: str) -> tuple[torch.Tensor, list[list[int]], float]:
    """Logits, greedy tokens, and the share of the vocabulary this rank's embedding holds."""
    model = load_model(model_dir, torch.float32, "cpu")
    runner = SequenceRunner(model)
    logits = runner.forward_whole(PROMPTS[0])
    share = model.model.embed_tokens.weight.shape[0] / model.config.vocab_size
    return logits, runner.generate_greedy(PROMPTS, max_tokens=12, prefill_chunk=16), share


def _rank(rank: int, world: int, port: int, model_dir: str, out, expert_parallel: bool) -> None:
    from vllm.distributed.parallel_state import destroy_distributed_environment, init_distributed_environment
    torch.set_num_threads(1)
    init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", torch.device("cpu"), timeout_s=60,
                                 expert_parallel=expert_parallel)
    try:
        logits, tokens, share = _run(model_dir)
        result = (logits.numpy(), tokens, share)  # by value: a tensor would go through shared memory, gone once we exit
    except BaseException as e:  # the parent reports it rather than waiting for a result that never comes
        result = f"rank {rank}: {type(e).__name__}: {e}"
    finally:
        destroy_distributed_environment()
    if rank == 0 or isinstance(result, str):
        out.put(result)


def run_ranks(model_dir: str, expert_parallel: bool, world: int = 2):
    """Rank 0's (logits, tokens) from `world` spawned ranks."""
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), _port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, model_dir, out, expert_parallel)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=120)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert not isinstance(result, str), result
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return result


@pytest.fixture(scope="module")
def kimi_linear_dir(tmp_path_factory) -> str:
    from vllm.tools.make_tiny_model import main as make
    out = tmp_path_factory.mktemp("kimi_linear")
    make(["--family", "kimi_linear", "--out", str(out), "--seed", "3", "--vocab-size", "2048", "--shards", "2"])
    return str(out)


# The two MoE splits across the two families (each pairing covers a latent and a plain MoE once).
@pytest.mark.parametrize("which, expert_parallel", [("builtin", False), ("kimi_linear", True)],
                         ids=["builtin-tp", "kimi_linear-tp_ep"])
def test_two_ranks_equal_one(which, expert_parallel, kimi_linear_dir):
    model_dir = str(DEFAULT_MODEL_DIR) if which == "builtin" else kimi_linear_dir
    want_logits, want_tokens, _ = _run(model_dir)
    logits, tokens, share = run_ranks(model_dir, expert_parallel)
    assert share == 0.5  # rank 0 held half the vocabulary (and half the heads): the model really was split
    assert tokens == want_tokens
    torch.testing.assert_close(torch.from_numpy(logits), want_logits, atol=2e-4, rtol=1e-4)


def test_sizes_the_tensor_parallel_size_does_not_divide_are_named():
    from vllm.model_executor.model_loader import load_config
    from vllm.model_executor.tp_shard import check_divisible
    config = load_config(DEFAULT_MODEL_DIR)  # 4 KDA heads, 8 MLA heads, widths 768 / 128, vocab 4096
    check_divisible(config, 4)
    with pytest.raises(ValueError) as e:
        check_divisible(config, 3)
    assert str(e.value).startswith("--tensor-parallel-size 3 must divide the model's kda_num_heads=4, "
                                   "num_attention_heads=8, moe_intermediate_size=128, vocab_size=4096")
