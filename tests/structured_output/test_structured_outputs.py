"""Structured outputs (xgrammar): every output token is one its grammar allows; a finished output is complete
(valid JSON of the schema, a full regex match, one of the choices); greedy outputs are identical with async
scheduling on and off, alone and batched with unconstrained requests, and beside speculating requests; a grammar
that cannot finish within max_tokens ends with "length"; a grammar that fails in the engine fails its request
alone and leaks nothing. The device mask is checked against xgrammar's own kernel on fresh random inputs."""
from __future__ import annotations

import json
import re
import threading

import pytest
import torch
import xgrammar as xgr

from vllm import LLM, SamplingParams
from vllm.assets import DEFAULT_DSPARK_DIR
from vllm.engine.llm_engine import LLMEngine
from vllm.sample.grammar_bitmask import GrammarBitmask, apply_grammar_bitmask
from vllm.structured_output.manager import StructuredOutputManager
from vllm.structured_output.params import StructuredOutputsParams
from vllm.worker.model_runner import ModelRunner

BASE = dict(max_model_len=256, dtype="float32", max_num_batched_tokens=64, max_num_seqs=8)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
CONSTRAINTS = [{"json": SCHEMA, "disable_any_whitespace": True}, {"regex": r"[0-9]{3}-[a-z]{2,5}"},
               {"choice": ["yes", "no", "maybe so"]}, {"json_object": True, "disable_any_whitespace": True},
               {"grammar": 'root ::= "(" digit+ ("+" digit+)* ")"\ndigit ::= [0-9]'}]
PROMPTS = ["Tell me about a person:", "def f(x):", "The answer is", "{", "1 + 2 ="]


@pytest.fixture(scope="module")
def llms():
    return {"async": LLM(**BASE, async_scheduling=True), "sync": LLM(**BASE, async_scheduling=False)}


def constrained(so: dict, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 48, **kw}, structured_outputs=so)


def check_output(llm: LLM, so: dict, token_ids: list[int], text: str, finish_reason: str) -> None:
    """Every token passes a fresh matcher of the same grammar; a stopped output is complete."""
    manager = StructuredOutputManager(llm.get_tokenizer(), llm.llm_engine.vocab_size,
                                      llm.llm_engine.eos_token_ids, 1, torch.device("cpu"))
    matcher = xgr.GrammarMatcher(manager._compile(StructuredOutputsParams.from_dict(so)))
    for t in token_ids:
        assert matcher.accept_token(t), f"token {t} of {text!r} breaks {so}"
    assert finish_reason in ("stop", "length")
    if finish_reason == "length":
        return
    assert matcher.is_terminated()
    if "json" in so:
        value = json.loads(text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int) and len(value["name"]) <= 6
    elif "json_object" in so:
        assert isinstance(json.loads(text), dict)
    elif "regex" in so:
        assert re.fullmatch(so["regex"], text)
    elif "choice" in so:
        assert text in so["choice"]
    else:
        assert re.fullmatch(r"\(\d+(\+\d+)*\)", text)


def test_device_mask_matches_xgrammar_kernel():
    gen = torch.Generator().manual_seed(0)
    for vocab in (4096, 1000):  # a vocabulary that is not a multiple of 32 leaves a partial last word
        logits = torch.randn(6, vocab, generator=gen)
        bitmask = torch.randint(-2**31, 2**31 - 1, (3, -(-vocab // 32)), generator=gen, dtype=torch.int64).int()
        rows = torch.tensor([4, 0, 2])
        want = logits.clone()
        full = torch.full((6, bitmask.shape[1]), -1, dtype=torch.int32)
        full[rows] = bitmask
        xgr.apply_token_bitmask_inplace(want, full)
        got = apply_grammar_bitmask(logits, GrammarBitmask(rows, bitmask))
        assert torch.equal(got, want)
        assert torch.isinf(got[rows]).any() and not torch.isinf(got[[1, 3, 5]]).any()
        # Every sampling row constrained, in order: masked without the gather, the caller's logits untouched.
        before = logits[:3].clone()
        got = apply_grammar_bitmask(logits[:3], GrammarBitmask(torch.arange(3), bitmask, every_row=True))
        want = logits[:3].clone()
        xgr.apply_token_bitmask_inplace(want, bitmask)
        assert torch.equal(got, want) and torch.isinf(got).any() and torch.equal(logits[:3], before)


@pytest.mark.parametrize("so,expected", [
    ({"regex": "("}, "structured_outputs.regex is not valid: Regex parsing error"),
    ({"json": "{bad"}, "structured_outputs.json is not valid: Failed to parse JSON"),
    ({"json": {"type": "nonsense"}}, 'structured_outputs.json is not valid: Unsupported type "nonsense"'),
    ({"grammar": "root ::= foo"}, 'structured_outputs.grammar is not valid: EBNF parser error at line 1, column 10: '
                                  'Rule "foo" is not defined'),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list of strings"),
    ({"regex": "a", "choice": ["x"]}, "exactly one of json, json_object, regex, choice or grammar; got regex, choice"),
    ({}, "got none"),
    ({"jsn": {}}, "unknown keys ['jsn']"),
])
def test_malformed_constraints_are_refused_by_name(so, expected):
    with pytest.raises(ValueError) as e:
        SamplingParams(structured_outputs=so)
    assert expected in str(e.value)


def test_outputs_follow_their_grammar_with_and_without_async_scheduling(llms, monkeypatch):
    # The async engine's masks must come from steps drained while the next forward was already queued.
    overlapped, real_drain, real_execute = [0], LLMEngine._drain, ModelRunner.execute_model
    inside = [False]

    def drain(self):
        overlapped[0] += inside[0] and self.in_flight is not None
        return real_drain(self)

    def execute(self, *args, **kwargs):
        inside[0] = True
        try:
            return real_execute(self, *args, **kwargs)
        finally:
            inside[0] = False
    monkeypatch.setattr(LLMEngine, "_drain", drain)
    monkeypatch.setattr(ModelRunner, "execute_model", execute)
    params = [constrained(so) for so in CONSTRAINTS] + [SamplingParams(temperature=0.0, max_tokens=24)]
    results = {}
    for name, llm in llms.items():
        outs = llm.generate(PROMPTS + ["plain"], params, use_tqdm=False)
        results[name] = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
        for so, (ids, text, reason) in zip(CONSTRAINTS, results[name]):
            check_output(llm, so, ids, text, reason)
        llm.llm_engine.kv_cache_manager.assert_all_free()
    assert results["async"] == results["sync"]
    assert overlapped[0] > 10
    assert sum(r == "stop" for _, _, r in results["async"][:len(CONSTRAINTS)]) >= 3, results["async"]
    # Alone, each constrained request gives what it gave in the batch.
    llm = llms["async"]
    for i, so in enumerate(CONSTRAINTS):
        out = llm.generate([PROMPTS[i]], [constrained(so)], use_tqdm=False)[0].outputs[0]
        assert (out.token_ids, out.text, out.finish_reason) == results["async"][i]


def test_sampled_outputs_follow_their_grammar(llms):
    llm = llms["async"]
    params = [constrained(so, temperature=1.0, seed=7, n=3) for so in CONSTRAINTS]
    for so, out in zip(CONSTRAINTS, llm.generate(PROMPTS, params, use_tqdm=False)):
        assert len(out.outputs) == 3
        for c in out.outputs:
            check_output(llm, so, c.token_ids, c.text, c.finish_reason)


def test_a_grammar_longer_than_max_tokens_ends_with_length(llms):
    llm = llms["async"]
    so = {"regex": "a{40}"}
    outs = llm.generate(["x", "y"], [constrained(so, max_tokens=5), SamplingParams(temperature=0.0, max_tokens=5)],
                        use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "length" and len(outs[0].outputs[0].token_ids) == 5
    assert set(outs[0].outputs[0].text) <= {"a"}
    assert outs[1].outputs[0].finish_reason == "length"


def test_speculating_neighbours_keep_their_outputs():
    plain = LLM(**BASE)
    spec = LLM(**BASE, speculative_config={"method": "dspark", "model": str(DEFAULT_DSPARK_DIR),
                                           "num_speculative_tokens": 3})
    params = [constrained(so) for so in CONSTRAINTS[:2]] + [SamplingParams(temperature=0.0, max_tokens=32)] * 2
    prompts = PROMPTS[:2] + ["The quick brown fox", "import numpy as np\n"]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == want
    stats = spec.llm_engine.spec_decode_stats
    assert stats.num_draft_tokens > 0, "the unconstrained requests speculated"
    spec.llm_engine.kv_cache_manager.assert_all_free()


def test_a_grammar_failing_in_the_engine_fails_its_request_alone(llms, monkeypatch):
    llm = llms["async"]

    def broken(self, params):
        if params.regex == "b+":
            raise RuntimeError("compiler ran out of memory")
        return real(self, params)
    real = StructuredOutputManager._compile
    monkeypatch.setattr(StructuredOutputManager, "_compile", broken)
    params = [constrained({"regex": "b+"}), constrained({"regex": "[0-9]+"}, max_tokens=8),
              SamplingParams(temperature=0.0, max_tokens=8)]
    outs = llm.generate(["a", "b", "c"], params, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert "failed to compile: compiler ran out of memory" in outs[0].error
    assert outs[1].outputs[0].text.isdigit() and outs[2].outputs[0].finish_reason == "length"
    assert not llm.llm_engine.has_unfinished_requests()
    llm.llm_engine.kv_cache_manager.assert_all_free()


def test_a_slow_compile_holds_up_only_its_own_request(llms, monkeypatch):
    """The request waits in the queue while its grammar compiles; the request behind it runs to its end."""
    llm = llms["async"]
    release, real = threading.Event(), StructuredOutputManager._compile

    def slow(self, params):
        assert release.wait(30)
        return real(self, params)
    monkeypatch.setattr(StructuredOutputManager, "_compile", slow)
    engine = llm.llm_engine
    engine.add_request("slow", "x", constrained({"regex": "[0-9]{4}"}))
    engine.add_request("plain", "y", SamplingParams(temperature=0.0, max_tokens=4))
    finished = {}
    while "plain" not in finished:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.scheduler.requests["slow"].status.value == "waiting"
    release.set()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert re.fullmatch("[0-9]{4}", finished["slow"].outputs[0].text)
    engine.kv_cache_manager.assert_all_free()


@pytest.mark.gpu
def test_on_cuda_with_graphs_the_mask_and_outputs_hold():
    """On the GPU the mask runs inside the decode step (graphs on by default): the device mask equals xgrammar's own
    CUDA kernel, constrained outputs are complete, and async outputs equal sync outputs."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(5, 163840, device="cuda", generator=gen)
    words = -(-logits.shape[1] // 32)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, words), device="cuda", generator=gen, dtype=torch.int64).int()
    full = torch.full((5, words), -1, dtype=torch.int32, device="cuda")
    full[[3, 1]] = bitmask
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, full)
    assert torch.equal(apply_grammar_bitmask(logits, GrammarBitmask(torch.tensor([3, 1], device="cuda"), bitmask)),
                       want)
    kw = dict(max_model_len=256, dtype="bfloat16", max_num_seqs=8)
    params = [constrained(so) for so in CONSTRAINTS] + [SamplingParams(temperature=0.0, max_tokens=24)]
    results = {}
    for name, async_scheduling in (("async", True), ("sync", False)):
        llm = LLM(**kw, async_scheduling=async_scheduling)
        outs = llm.generate(PROMPTS + ["plain"], params, use_tqdm=False)
        results[name] = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
        for so, (ids, text, reason) in zip(CONSTRAINTS, results[name]):
            check_output(llm, so, ids, text, reason)
        llm.llm_engine.kv_cache_manager.assert_all_free()
        del llm
    assert results["async"] == results["sync"]


def test_one_compile_per_grammar_and_no_spinning_while_it_runs(llms, monkeypatch):
    """Requests with the same constraint share one compile; an engine with nothing else to run waits on the
    compile instead of spinning on step() (which held the GIL the compiling thread needs: thousands of empty
    steps before a request was admitted)."""
    llm = llms["async"]
    so = {"json": {"type": "object", "properties": {"k": {"type": "string", "minLength": 64}}, "required": ["k"]}}
    engine, steps = llm.llm_engine, [0]
    real = LLMEngine.step

    def counted(self):
        steps[0] += 1
        return real(self)
    monkeypatch.setattr(LLMEngine, "step", counted)
    params = constrained(so, max_tokens=6)
    first = llm.generate(["a", "b", "c"], params, use_tqdm=False)
    cold = steps[0]
    futures = {id(f) for f in engine.structured._compiles.values()}
    steps[0] = 0
    again = llm.generate(["a", "b", "c"], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert steps[0] <= 6 + 2, f"{steps[0]} steps for 6 tokens with the grammar compiled"
    assert cold <= 6 + 2 + 50, f"{cold} steps for 6 tokens while the grammar compiled"
    assert {id(f) for f in engine.structured._compiles.values()} == futures, "the same constraint compiled once"
