"""Beam search over the engine, as upstream's `LLM.beam_search`: every step asks the engine for one token with
the top 2 x beam_width logprobs of each live beam, extends each beam by each of them, and keeps the beam_width
best by length-penalised cumulative logprob. Finished beams (eos, unless ignore_eos) are set aside; at the end
the beam_width best of finished and live beams come back, best first. Each step sends every beam whole as a
prompt: without the prefix cache (--no-enable-prefix-caching) that costs O(max_tokens^2) tokens, a tool for short
answers; with it, the engine skips what its cache holds of each beam's prefix."""
from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Sequence
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


@dataclass(slots=True)
class _Beam:
    """A beam during the search: its last token, that step's logprob row, and the beam it grew from. A candidate
    costs O(1) however long the beam is (histories are shared through `parent`, never copied); only a beam kept
    to run a step holds its whole sequence, the engine's prompt."""
    parent: _Beam | None  # None: the prompt itself
    token: int
    row: dict[int, Logprob] | None
    cum_logprob: float
    length: int  # prompt and generated tokens
    score: float = 0.0
    tokens: list[int] | None = None  # while live
    finish_reason: str | None = None
    stop_reason: int | None = None

    def sequence(self, prompt: list[int]) -> BeamSearchSequence:
        """The upstream-shaped result, walked back from this beam to the prompt: O(length), once per result."""
        generated, rows, beam = [], [], self
        while beam.parent is not None:
            generated.append(beam.token)
            rows.append(beam.row)
            beam = beam.parent
        return BeamSearchSequence(list(prompt) + generated[::-1], rows[::-1], self.cum_logprob,
                                  finish_reason=self.finish_reason, stop_reason=self.stop_reason)


def beam_score(tokens: list[int], cum_logprob: float, eos_token_ids: frozenset[int], length_penalty: float) -> float:
    """Upstream's score: cumulative logprob over length ** length_penalty, a final eos not counted."""
    return _score(len(tokens), bool(tokens) and tokens[-1] in eos_token_ids, cum_logprob, length_penalty)


def _score(length: int, ends_in_eos: bool, cum_logprob: float, length_penalty: float) -> float:
    return cum_logprob / (max(length - ends_in_eos, 1) ** length_penalty)


BeamSteps = Generator[list[dict], list[RequestOutput], list[BeamSearchOutput]]


def beam_step_params(params: BeamSearchParams, logprobs: int | None = None) -> SamplingParams:
    """What each step asks of the engine for every live beam: one token with the top 2 x beam_width logprobs,
    or more where the caller returns `logprobs` per token (-1: the whole vocabulary)."""
    k = -1 if logprobs == -1 else max(2 * params.beam_width, logprobs or 0)
    return SamplingParams(max_tokens=1, logprobs=k, temperature=params.temperature, ignore_eos=True,
                          detokenize=False)


def beam_search_steps(decode: Callable[[list[int]], str] | None, prompts: Sequence[list[int]], params: BeamSearchParams,
                      eos_token_ids: frozenset[int]) -> BeamSteps:
    """The search as a generator, so that a blocking caller (`beam_search`) and the server's event loop drive the
    same code: it yields each step's token prompts, is sent their outputs (with `beam_step_params`), and returns
    the results. `decode` turns ids into text (None: the caller decodes, texts stay None).

    Host work per step is O(1) per candidate; only the beams kept to run the next step are spelt out, as the
    engine's prompts (the engine reads them whole anyway, from its prefix cache where it holds them)."""
    width = params.beam_width
    live = [[_Beam(None, -1, None, 0.0, len(p), tokens=list(p))] for p in prompts]
    done: list[list[_Beam]] = [[] for _ in prompts]  # each prompt's best `width` finished beams so far
    for _ in range(params.max_tokens):
        flat = [(i, beam) for i, beams in enumerate(live) for beam in beams]
        if not flat:
            break
        outs = yield [{"prompt_token_ids": beam.tokens} for _, beam in flat]
        grown: list[list[_Beam]] = [[] for _ in prompts]
        finished: list[list[_Beam]] = [[] for _ in prompts]
        for (i, beam), out in zip(flat, outs):
            row = step_row(out)
            for tid, lp in candidates(row, 2 * width):
                eos = tid in eos_token_ids
                child = _Beam(beam, tid, row, beam.cum_logprob + lp.logprob, beam.length + 1)
                child.score = _score(child.length, eos, child.cum_logprob, params.length_penalty)
                if eos and not params.ignore_eos:
                    child.finish_reason, child.stop_reason = "stop", tid
                    finished[i].append(child)
                else:
                    grown[i].append(child)
        for i in range(len(prompts)):
            done[i] = best(done[i] + finished[i], width)
            live[i] = best(grown[i], width)
            for child in live[i]:
                child.tokens = child.parent.tokens + [child.token]
        for _, beam in flat:
            beam.tokens = None  # no longer live: its children hold their own
    results = []
    for i, prompt in enumerate(prompts):
        for beam in live[i]:
            beam.finish_reason, beam.tokens = "length", None
        seqs = [beam.sequence(prompt) for beam in best(done[i] + live[i], width)]
        for seq in seqs if decode is not None else ():
            seq.text = decode(seq.tokens)
        results.append(BeamSearchOutput(seqs))
    return results


def best(beams: list[_Beam], width: int) -> list[_Beam]:
    """The `width` best by score; ties keep their order (a stable sort, as upstream's)."""
    return sorted(beams, key=_by_score, reverse=True)[:width]


def _by_score(beam: _Beam) -> float:
    return beam.score


def candidates(row: dict[int, Logprob], k: int) -> Iterable[tuple[int, Logprob]]:
    """A step's candidates: its sampled token (the row's first) and the top k. A row holds more only when the
    caller asked for more logprobs than the search needs."""
    if len(row) <= k + 1:
        return row.items()
    sampled = next(iter(row))
    return [(tid, lp) for tid, lp in row.items() if tid == sampled or lp.rank <= k]


def step_row(out: RequestOutput) -> dict[int, Logprob]:
    """The candidates of a beam's step: its one token's logprob row (the top 2 x width)."""
    c = out.outputs[0]
    if not c.logprobs:
        raise RuntimeError(f"a beam search step returned no logprobs (finish_reason {c.finish_reason!r}"
                           + (f": {out.error}" if out.error else "") + ")")
    return c.logprobs[0]


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
