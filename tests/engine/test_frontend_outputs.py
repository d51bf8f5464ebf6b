"""Outputs built in the front end from the core's records (core_outputs.py -> frontend_outputs.py, the served
engine's layout) equal the outputs the in-process engine builds itself, for every sampling feature the
output path handles: stop strings (finished by the front end, freed by the core a step later), n > 1, logprobs,
prompt logprobs, every output kind, aborts. Both engines run in this process on the built-in model."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm.assets import DEFAULT_MODEL_DIR
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.frontend_outputs import FrontEndOutputs
from vllm.engine.llm_engine import LLMEngine
from vllm.outputs import OutputJoiner
from vllm.sampling_params import RequestOutputKind, SamplingParams

ARGS = dict(model=str(DEFAULT_MODEL_DIR), dtype="float32", device="cpu", max_model_len=256, seed=0)


@pytest.fixture(scope="module")
def engines():
    config = EngineArgs(**ARGS).create_engine_config()
    here, core = LLMEngine(config), LLMEngine(EngineArgs(**ARGS).create_engine_config(), front_end_outputs=True)
    return here, core, FrontEndOutputs(core.tokenizer, config.num_speculative_tokens)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(step, add, abort, requests, abort_after: dict[str, int]) -> dict:
    joined = {rid: OutputJoiner() for rid, _, _ in requests}
    last = {}
    for rid, ids, params in requests:
        add(rid, ids, params)
    steps = 0
    while any(not (last.get(rid) is not None and last[rid].finished) for rid in joined):
        steps += 1
        outs = step()
        for rid, n in abort_after.items():
            if steps == n:
                outs += abort(rid)
        for out in outs:
            last[out.request_id] = out
            joined[out.request_id].add(out) if requests_kind(requests, out.request_id) is RequestOutputKind.DELTA \
                else None
        assert steps < 500, "the requests never finished"
    return {rid: (joined[rid].pop() if joined[rid] else last[rid]) for rid in joined}


def requests_kind(requests, rid):
    return next(p.output_kind for r, _, p in requests if r == rid)


def summary(out) -> list:
    return [(c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason, c.cumulative_logprob,
             None if c.logprobs is None else [{t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in pos.items()}
                                              for pos in c.logprobs]) for c in out.outputs] + [
        out.prompt_token_ids, out.num_cached_tokens, out.finished,
        None if out.prompt_logprobs is None else [None if p is None else sorted(p) for p in out.prompt_logprobs]]


def test_front_end_outputs_equal_the_in_process_ones(engines):
    here, core, front = engines
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    first = here.tokenizer.decode(_greedy_ids(here, prompt(7, 1), greedy))
    stop = next(first[i:i + 3] for i in range(4, len(first) - 3) if first[i:i + 3].strip())  # reached mid-way
    cases = [
        ("stop", prompt(7, 1), dataclasses.replace(greedy, stop=[stop])),
        ("stop-kept", prompt(7, 1), dataclasses.replace(greedy, stop=[stop], include_stop_str_in_output=True,
                                                        output_kind=RequestOutputKind.DELTA)),
        ("n2", prompt(9, 2), SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True,
                                            stop=[stop])),
        ("logprobs", prompt(5, 3), SamplingParams(temperature=0.8, seed=1, max_tokens=10, logprobs=2,
                                                  prompt_logprobs=1, ignore_eos=True)),
        ("delta", prompt(11, 4), dataclasses.replace(greedy, logprobs=0, output_kind=RequestOutputKind.DELTA)),
        ("final", prompt(6, 5), dataclasses.replace(greedy, output_kind=RequestOutputKind.FINAL_ONLY)),
        ("aborted", prompt(8, 6), dataclasses.replace(greedy, max_tokens=200)),
    ]
    abort_after = {"aborted": 5}
    base = here.output_processor.num_generation_tokens, here.output_processor.num_prompt_tokens_cached  # the probe
    ours = run(here.step, lambda rid, ids, p: here.add_request(rid, {"prompt_token_ids": ids}, p),
               here.abort_request, cases, abort_after)

    def step():
        outputs, finished = front.apply(core.step())
        core.finish_children(finished)
        return outputs

    def add(rid, ids, p):
        front.add(rid, None, ids, p)
        core.add_request(rid, {"prompt_token_ids": ids}, p)

    def abort(rid):
        return front.apply(core.abort_request(rid))[0]
    theirs = run(step, add, abort, cases, abort_after)
    for rid, _, _ in cases:
        assert summary(theirs[rid]) == summary(ours[rid]), rid
    assert ours["stop"].outputs[0].finish_reason == "stop" and ours["aborted"].outputs[0].finish_reason == "abort"
    assert ours["logprobs"].prompt_logprobs is not None and ours["n2"].outputs[1].text
    # the core freed everything, and counted the tokens each request kept as the in-process engine does
    assert not core.has_unfinished_requests() and not core.output_processor.parents and not front.views
    assert core.output_processor.num_generation_tokens == here.output_processor.num_generation_tokens - base[0]
    assert core.output_processor.num_prompt_tokens_cached == here.output_processor.num_prompt_tokens_cached - base[1]


def _greedy_ids(engine: LLMEngine, ids: list[int], params: SamplingParams) -> list[int]:
    engine.add_request("probe", {"prompt_token_ids": ids}, params)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    return out.outputs[0].token_ids


def test_a_refused_request_leaves_nothing_in_the_front_end(engines):
    _, core, _ = engines
    front = FrontEndOutputs(core.tokenizer)
    front.add("bad", None, [5, 6], SamplingParams(n=2))
    assert set(front.views) == {"bad-0", "bad-1"} and "bad" in front.processor.parents
    front.discard("bad")
    assert not front.views and not front.children
    assert not front.processor.parents and not front.processor.child_parent
