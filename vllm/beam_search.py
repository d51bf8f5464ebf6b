"""Beam search over the engine, as upstream's `LLM.beam_search`: every step asks the engine for one token with
the top 2 x beam_width logprobs of each live beam, extends each beam by each of them, and keeps the beam_width
best by length-penalised cumulative logprob. Finished beams (eos, unless ignore_eos) are set aside; at the end
the beam_width best of finished and live beams come back, best first. Each step recomputes every beam's prefix
(there is no prefix caching), so this costs O(max_tokens^2) tokens: a tool for short answers."""
from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

from vllm.outputs import Logprob, RequestOutput
from vllm.sampling_params import BeamSearchParams, SamplingParams


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam: the prompt's tokens then the generated ones (upstream's layout), their logprobs, and the text of
    all of them once decoded."""
    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (eos) or "length"
    stop_reason: int | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_score(tokens: list[int], cum_logprob: float, eos_token_ids: frozenset[int], length_penalty: float) -> float:
    """Upstream's score: cumulative logprob over length ** length_penalty, a final eos not counted."""
    n = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    return cum_logprob / (max(n, 1) ** length_penalty)


BeamSteps = Generator[list[dict], list[RequestOutput], list[BeamSearchOutput]]


def beam_step_params(params: BeamSearchParams) -> SamplingParams:
    """What each step asks of the engine for every live beam: one token with the top 2 x beam_width logprobs."""
    return SamplingParams(max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature,
                          ignore_eos=True, detokenize=False)


def beam_search_steps(decode: Callable[[list[int]], str] | None, prompts: Sequence[list[int]], params: BeamSearchParams,
                      eos_token_ids: frozenset[int]) -> BeamSteps:
    """The search as a generator, so that a blocking caller (`beam_search`) and the server's event loop drive the
    same code: it yields each step's token prompts, is sent their outputs (with `beam_step_params`), and returns
    the results. `decode` turns ids into text (None: the caller decodes, texts stay None)."""
    width = params.beam_width

    def score(beam: BeamSearchSequence) -> float:
        return beam_score(beam.tokens, beam.cum_logprob, eos_token_ids, params.length_penalty)

    live = [[BeamSearchSequence(tokens=list(p))] for p in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        flat = [(i, beam) for i, beams in enumerate(live) for beam in beams]
        if not flat:
            break
        outs = yield [{"prompt_token_ids": beam.tokens} for _, beam in flat]
        grown: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, beam), out in zip(flat, outs):
            for tid, lp in out.outputs[0].logprobs[0].items():
                child = BeamSearchSequence(beam.tokens + [tid], beam.logprobs + [out.outputs[0].logprobs[0]],
                                           beam.cum_logprob + lp.logprob)
                if tid in eos_token_ids and not params.ignore_eos:
                    child.finish_reason, child.stop_reason = "stop", tid
                    done[i].append(child)
                else:
                    grown[i].append(child)
        live = [sorted(g, key=score, reverse=True)[:width] for g in grown]
    results = []
    for i in range(len(prompts)):
        for beam in live[i]:
            beam.finish_reason = "length"
        best = sorted(done[i] + live[i], key=score, reverse=True)[:width]
        for beam in best if decode is not None else ():
            beam.text = decode(beam.tokens)
        results.append(BeamSearchOutput(best))
    return results


def beam_search(generate: Callable[[list[dict], SamplingParams], list[RequestOutput]],
                decode: Callable[[list[int]], str] | None, prompts: Sequence[list[int]], params: BeamSearchParams,
                eos_token_ids: frozenset[int]) -> list[BeamSearchOutput]:
    """`generate(prompts, sampling_params)` runs token prompts in one batch; `decode` turns ids into text (None:
    texts stay None). A beam ends at any of `eos_token_ids`."""
    steps, step_params = beam_search_steps(decode, prompts, params, eos_token_ids), beam_step_params(params)
    try:
        batch = next(steps)
        while True:
            batch = steps.send(generate(batch, step_params))
    except StopIteration as finished:
        return finished.value
