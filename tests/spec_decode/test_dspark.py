"""DSpark drafts (`--speculative-config '{"method": "dspark", ...}'`), CPU: the draft model's paged context and
its batch, the target's captured hidden states, the checkpoint's fit to the target, and the engine greedy
lossless with DSpark at K = 1, 3, 7 over mixed batches, chunked prefill, preemption and aborts.

The unit tests' draft has random weights (verification must make the output exact whatever it drafts); the
engine's lossless runs use the draft trained for the built-in model, whose drafts are accepted.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from code_prompts import CODE_PROMPTS
from safetensors.torch import load_file, save_file
from sequence_runner import SequenceRunner

from vllm import LLM, SamplingParams
from vllm.assets import DEFAULT_DSPARK_DIR, DEFAULT_MODEL_DIR
from vllm.model_executor.dspark_loader import load_dspark_draft
from vllm.model_executor.model_loader import load_config, load_model
from vllm.tools.make_dspark_draft import write_dspark_draft
from vllm.tools.make_tiny_model import write_tiny_model
from vllm.transformers_utils.checkpoint_errors import MissingTensorError, UnexpectedTensorError

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return write_dspark_draft(tmp_path_factory.mktemp("dspark"), seed=1)


@pytest.fixture(scope="module")
def draft(draft_dir):
    return load_dspark_draft(draft_dir, load_config(DEFAULT_MODEL_DIR), torch.float32, "cpu")


def _llm(draft_dir=None, K=3, **kwargs) -> LLM:
    spec = {"method": "dspark", "model": draft_dir, "num_speculative_tokens": K} if draft_dir else None
    kwargs.setdefault("max_model_len", 256)
    return LLM(dtype="float32", speculative_config=spec, **kwargs)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


# ---- the draft model -------------------------------------------------------------------------------------------
def _bind(draft, num_blocks=16, block_size=4):
    cfg = draft.config
    draft.bind_caches([torch.zeros(num_blocks, block_size, cfg.mla_cache_dim) for _ in draft.layers])
    return block_size


def _propose(draft, target, anchors, anchor_pos, table, max_context):
    return draft.propose(torch.tensor(anchors), torch.tensor(anchor_pos), table, max_context, 4,
                         target.model.embed_tokens, target.lm_head.weight)


def test_context_is_read_through_the_block_table_and_only_below_the_anchor(draft):
    """The same context written at two different block layouts drafts the same tokens; rows past a request's
    anchor (a rejected draft's leftovers) and other requests' rows change nothing; two requests batched draft
    what each drafts alone."""
    target = load_model(DEFAULT_MODEL_DIR, "float32")
    gen = torch.Generator().manual_seed(0)
    n_ctx = len(draft.config.target_layer_ids) * target.config.hidden_size
    ctx = torch.randn(10, n_ctx, generator=gen)
    bs = _bind(draft)
    pos = torch.arange(10)

    def write(blocks, rows):
        slots = torch.tensor(blocks)[pos // bs] * bs + pos % bs
        draft.write_context(rows, pos, slots)
        return torch.tensor([blocks + [0] * (6 - len(blocks))], dtype=torch.int32)

    table_a = write([3, 7, 1], ctx)
    alone, conf, _ = _propose(draft, target, [42], [8], table_a, 10)
    assert alone.shape == (1, 4) and conf.shape == (1, 4) and ((conf > 0) & (conf < 1)).all()
    table_b = write([12, 2, 9], ctx)
    assert torch.equal(_propose(draft, target, [42], [8], table_b, 10)[0], alone)
    garbage = ctx.clone()
    garbage[8:] = torch.randn(2, n_ctx, generator=gen) * 10
    write([12, 2, 9], garbage)  # positions 8, 9 are past the anchor: not context
    assert torch.equal(_propose(draft, target, [42], [8], table_b, 10)[0], alone)
    other = torch.randn(10, n_ctx, generator=gen)
    table_c = write([4, 5, 6], other)
    both = _propose(draft, target, [7, 42], [10, 8], torch.cat([table_c, table_b]), 10)[0]
    assert torch.equal(both[1], alone[0])
    assert torch.equal(both[0], _propose(draft, target, [7], [10], table_c, 10)[0][0])
    assert not torch.equal(_propose(draft, target, [42], [8], table_c, 10)[0], alone), "context is read"


def test_the_served_rope_table_gives_the_computed_angles(draft):
    """Serving reads RoPE's factors from a table built once; training computes them: the same values bit for bit
    for positions anywhere in the table, which serving does read. Served drafts (table, explicit attention)
    are the training form's (computed angles, SDPA) up to the attention's rounding."""
    from vllm.model_executor.models.dspark.model import rope_factors
    target = load_model(DEFAULT_MODEL_DIR, "float32")
    gen = torch.Generator().manual_seed(3)
    bs = _bind(draft)
    n_ctx = len(draft.config.target_layer_ids) * target.config.hidden_size
    pos = torch.arange(12)
    draft.write_context(torch.randn(12, n_ctx, generator=gen), pos, pos)
    table = torch.arange(4, dtype=torch.int32)[None].repeat(2, 1)
    args = ([42, 7], [11, 5], table, 12)
    computed = _propose(draft, target, *args)
    draft.build_rope_table(16 + 4, "cpu")
    try:
        with torch.inference_mode():
            positions = torch.tensor([[0, 5, 19], [3, 11, 7]])
            cfg = draft.config
            assert torch.equal(draft.rope_factors_at(positions),
                               rope_factors(positions, cfg.qk_rope_head_dim, cfg.rope_theta))
            served = _propose(draft, target, *args)
            draft.rope_table[:, 1].zero_()  # the table is what serving reads: a wrong one shows
            assert not torch.equal(_propose(draft, target, *args)[1], served[1])
    finally:
        draft.rope_table = None
    assert torch.equal(computed[0], served[0])
    torch.testing.assert_close(computed[1], served[1], rtol=1e-5, atol=1e-6)
    assert bs * table.shape[1] <= 16


def test_served_attention_is_sdpa_on_random_masks():
    """The explicit attention serving runs against SDPA (what training runs) on fresh random inputs, with masks
    that hide different keys per query (each query keeps at least one)."""
    from vllm.model_executor.models.dspark.model import attend
    gen = torch.Generator().manual_seed(5)
    N, Q, S, H, d, dv = 3, 4, 37, 4, 48, 32
    q, k = torch.randn(N, Q, H, d, generator=gen), torch.randn(N, S, H, d, generator=gen)
    v = torch.randn(N, S, H, dv, generator=gen)
    mask = torch.rand(N, Q, S, generator=gen) < 0.6
    mask[..., -1] = True
    with torch.no_grad():
        served = attend(q, k, v, mask, 0.17)
    with torch.enable_grad():
        trained = attend(q, k, v, mask, 0.17)
    assert served.shape == (N, Q, H, dv)
    torch.testing.assert_close(served, trained, rtol=1e-5, atol=1e-5)
    hidden = mask.clone()
    hidden[0, 0, :-1] = False  # query (0, 0) now sees only the last key: its output is that key's value
    with torch.no_grad():
        torch.testing.assert_close(attend(q, k, v, hidden, 0.17)[0, 0], v[0, -1])


def test_captured_hidden_states_are_the_stream_after_each_layer(tmp_path):
    """Plain residual stacks and AttnRes stacks: the buffer holds the stream after each chosen layer; after
    the last layer of a plain stack that is the forward's own output."""
    for family in ("kimi_linear", "k3"):
        model = load_model(write_tiny_model(tmp_path / family, family), "float32")
        L, D = model.config.num_hidden_layers, model.config.hidden_size
        buf = torch.full((64, 2 * D), float("nan"))
        model.model.capture_hidden_states((0, L - 1), buf)
        tokens = list(range(5, 17))
        SequenceRunner(model, max_model_len=64).forward_whole(tokens)
        assert torch.isfinite(buf[:len(tokens)]).all() and torch.isnan(buf[len(tokens):]).all()
        assert not torch.equal(buf[:12, :D], buf[:12, D:])
        if family == "kimi_linear":  # forward returns the pre-norm stream after the last layer
            out = {}
            model.model.register_forward_hook(lambda m, a, o: out.__setitem__("h", o))
            SequenceRunner(model, max_model_len=64).forward_whole(tokens)
            torch.testing.assert_close(buf[:12, D:], out["h"], rtol=0, atol=0)


# ---- the checkpoint against its target --------------------------------------------------------------------------
@pytest.mark.parametrize("change,match", [
    ({"vocab_size": 512}, r"vocab_size 512 != the target's 4096"),
    ({"target_layer_ids": [1, 8]}, r"target_layer_ids \[1, 8\] must be a non-empty list of layer indices in \[0, 8\)"),
    ({"hidden_size": 128}, r"hidden_size 128 != the target's 256"),
    ({"target_layer_ids": [2, 2]}, "repeat a layer"),
])
def test_a_draft_that_does_not_fit_its_target_is_refused_naming_what_differs(tmp_path, draft_dir, change, match):
    cfg = json.loads((Path(draft_dir) / "config.json").read_text())
    out = tmp_path / "bad"
    write_dspark_draft(out, **{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")} | change)
    with pytest.raises(ValueError, match=match) as info:
        _llm(str(out))
    assert "does not fit the target model" in str(info.value)


def test_missing_and_unexpected_draft_tensors_are_named(tmp_path, draft_dir):
    tensors = load_file(str(Path(draft_dir) / "model.safetensors"))
    for name, edit, error in [("missing", lambda t: t.pop("markov_head.w2.weight"), MissingTensorError),
                              ("unexpected", lambda t: t.__setitem__("layers.9.mlp.up_proj.weight",
                                                                     torch.zeros(2, 2)), UnexpectedTensorError)]:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text((Path(draft_dir) / "config.json").read_text())
        broken = dict(tensors)
        edit(broken)
        save_file(broken, str(d / "model.safetensors"))
        with pytest.raises(error, match="markov_head.w2.weight" if name == "missing" else "layers.9.mlp"):
            load_dspark_draft(d, load_config(DEFAULT_MODEL_DIR), torch.float32, "cpu")
    shared = dict(tensors, **{"lm_head.weight": torch.zeros(4096, 256), "embed_tokens.weight": torch.zeros(1)})
    d = tmp_path / "shared"
    d.mkdir()
    (d / "config.json").write_text((Path(draft_dir) / "config.json").read_text())
    save_file(shared, str(d / "model.safetensors"))
    load_dspark_draft(d, load_config(DEFAULT_MODEL_DIR), torch.float32, "cpu")  # the target's copies: dropped


# ---- the engine ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("K", [1, 3, 7])
def test_dspark_greedy_is_lossless_with_accepted_drafts(K):
    """The shipped draft on the built-in model: output equal to no speculation, every request drafted for, and
    every acceptance count 0..K occurs (so the accepted-draft paths run, not only the all-rejected one)."""
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    want = _ids(_llm().generate(CODE_PROMPTS, params, use_tqdm=False))
    llm = _llm(str(DEFAULT_DSPARK_DIR), K)
    outs = llm.generate(CODE_PROMPTS, params, use_tqdm=False)
    assert _ids(outs) == want
    assert all(o.metrics.spec_num_drafts > 0 for o in outs)
    stats = llm.llm_engine.spec_decode_stats
    per_pos = stats.num_accepted_tokens_per_pos
    stopped_at = [stats.num_drafts - per_pos[0]] + [per_pos[j - 1] - (per_pos[j] if j < K else 0)
                                                   for j in range(1, K + 1)]
    assert all(n > 0 for n in stopped_at), (stats.num_drafts, per_pos)
    llm.llm_engine.kv_cache_manager.assert_all_free()


def test_dspark_is_lossless_under_chunking_preemption_and_aborts():
    prompts = [p * n for p, n in zip(CODE_PROMPTS, (1, 6, 2, 9, 3, 1))]
    want = _ids(_llm().generate(prompts, GREEDY, use_tqdm=False))
    llm = _llm(str(DEFAULT_DSPARK_DIR), 3, max_num_batched_tokens=16, num_gpu_blocks_override=9, max_model_len=128)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _ids(outs) == want
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert llm.llm_engine.spec_decode_stats.num_accepted_tokens > 0
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    for _ in range(6):
        engine.step()
    engine.abort_request(["r1", "r4"])
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert sorted(done) == ["r0", "r2", "r3", "r5"]
    assert [done[f"r{i}"] for i in (0, 2, 3, 5)] == [want[i] for i in (0, 2, 3, 5)]
    engine.kv_cache_manager.assert_all_free()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_engine_times_all_verify_steps_for_the_step_it_waited_for_without_idle_time(monkeypatch,
                                                                                         async_scheduling):
    """What adaptive verification's StepTimes get: the loop's period from one all-verify step to the next, its
    waits for the device (the period less them is the host's work), and the shape (requests, target tokens) of
    the step those waits were for: the step itself synchronously, the one launched before it under async
    scheduling; None if that one was no all-verify step. Never the idle time after the last request. On a fake
    clock each launch of an all-verify step costs 1 s of host work (any other 5 s) and each wait for the device
    10 s, and 100 s pass between two batches, the first of which ends in an all-verify step: every period is
    exactly 11 s (a period of a prefill step would be 15, one over the idle gap 100+)."""
    from types import SimpleNamespace

    from vllm.engine import llm_engine
    from vllm.spec_decode.adaptive_verification import StepTimes
    from vllm.worker.model_runner import AsyncModelRunnerOutput

    launched = []  # per step launched: (requests, target tokens, re-cut) if every row verified drafts, else None
    recorded = []  # per period: (period, waited, drained shape, the shape expected: the step it waited for)

    class Samples(StepTimes):
        def record(self, period, waited, drained):
            recorded.append((period, waited, drained, launched[-1 if not async_scheduling else -2]))

    clock = [0.0]
    monkeypatch.setattr(llm_engine, "time", SimpleNamespace(perf_counter=lambda: clock[0], monotonic=time.monotonic))
    get_output = AsyncModelRunnerOutput.get_output

    def waiting(self):
        clock[0] += 10.0
        out = get_output(self)
        self.waited = 10.0
        return out

    monkeypatch.setattr(AsyncModelRunnerOutput, "get_output", waiting)
    llm = _llm(str(DEFAULT_DSPARK_DIR), 3, async_scheduling=async_scheduling)
    runner = llm.llm_engine.runner
    runner.step_times = Samples()  # off CUDA the engine records nothing unless given somewhere to
    execute_model = runner.execute_model

    def launching(out, *args, **kwargs):
        # 1 s for a step whose every row verifies drafts, 5 s for any other: only the former are timed.
        all_verify = all(s.draft_token_ids for s in out.scheduled)
        clock[0] += 1.0 if all_verify else 5.0
        result = execute_model(out, *args, **kwargs)
        launched.append((len(out.scheduled), result.num_tokens, result.recut) if all_verify else None)
        return result

    runner.execute_model = launching
    # Alone, and stopped by a token that its 10th output is the first of: its last step verifies drafts.
    stopped = llm.generate(CODE_PROMPTS[2:3], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[270]),
                           use_tqdm=False)
    assert stopped[0].outputs[0].finish_reason == "stop"
    clock[0] += 100.0
    llm.generate(CODE_PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert len(recorded) >= 4
    assert all((period, waited) == (11.0, 10.0) for period, waited, _, _ in recorded)
    assert all(drained == expected for _, _, drained, expected in recorded)
    shapes = [drained for _, _, drained, _ in recorded if drained is not None]
    assert len(shapes) >= 3 and {3, 1} <= {reqs for reqs, _, _ in shapes}
    assert all(reqs < tokens <= 4 * reqs for reqs, tokens, _ in shapes)  # 1 + K = 4 target tokens a row at most


def test_adaptive_verification_refuses_backends_that_cannot_recut_rows(draft_dir):
    with pytest.raises(ValueError, match=r"enable_adaptive_verification needs attention backends that replay any "
                                         r"decode shape \(VARLEN_DECODE or ALWAYS\); KDAMetadataBuilder \(NEVER\)"):
        # The reference backends, on any device: they read the host's row lengths and replay no graph.
        LLM(dtype="float32", max_model_len=128, attention_backend="TORCH_MLA", kda_decode_backend="torch",
            kda_prefill_backend="torch", speculative_config={
            "method": "dspark", "model": draft_dir, "num_speculative_tokens": 2, "enable_adaptive_verification": True})


def test_padding_rows_write_their_context_to_the_scratch_slot_and_nowhere_else(draft):
    """Graph-padded tokens (slot -1) land in the cache's last slot, which no block table reaches: every real
    slot but the ones written keeps its bits, slot 0 included (a padding write there corrupted a real block
    without changing any output, only acceptance)."""
    _bind(draft)
    gen = torch.Generator().manual_seed(0)
    for layer in draft.layers:
        layer.self_attn.kv_cache.copy_(torch.randn(layer.self_attn.kv_cache.shape, generator=gen))
    before = [layer.self_attn.kv_cache.clone() for layer in draft.layers]
    width = draft.context_proj.in_features
    slots = torch.tensor([5, 9, -1, -1, 17])
    with torch.inference_mode():
        draft.write_context(torch.randn(len(slots), width, generator=gen), torch.arange(len(slots)), slots)
    for layer, old in zip(draft.layers, before):
        new = layer.self_attn.kv_cache.view(-1, draft.config.mla_cache_dim)
        old = old.view(-1, draft.config.mla_cache_dim)
        written = {5, 9, 17, new.shape[0] - 1}
        kept = [s for s in range(new.shape[0]) if s not in written]
        assert torch.equal(new[kept], old[kept])
        assert all(not torch.equal(new[s], old[s]) for s in written)
