"""RequestOutput / CompletionOutput, shaped like upstream's."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # Speculative decoding (summed over the n samples): verifications with >= 1 draft, proposed draft tokens,
    # accepted ones, and per draft position how often it was accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] | None = None

    @property
    def spec_mean_acceptance_length(self) -> float | None:
        """Tokens per verify step (1 + accepted / drafts); None without speculation."""
        if self.spec_num_accepted_tokens_per_pos is None:
            return None
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 1.0


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    extra: dict = field(default_factory=dict)
    # Set when a completion finished with "error": a step failed because of this request (the others ran on).
    error: str | None = None


class OutputJoiner:
    """Joins a request's DELTA outputs into one RequestOutput, in time and memory linear in their total size:
    texts are kept as pieces until `pop` (concatenating onto a growing string at every step would copy it each
    time), token ids and logprobs are extended in place."""

    def __init__(self) -> None:
        self.head: RequestOutput | None = None
        self.texts: dict[int, list[str]] = {}

    def __bool__(self) -> bool:
        return self.head is not None

    def add(self, out: RequestOutput) -> None:
        if self.head is None:
            self.head = out
            for c in out.outputs:
                c.token_ids = list(c.token_ids)
                c.logprobs = None if c.logprobs is None else list(c.logprobs)
                self.texts[c.index] = [c.text]
            return
        mine = {c.index: c for c in self.head.outputs}
        for c in out.outputs:
            m = mine.get(c.index)
            if m is None:
                self.head.outputs.append(c)
                self.texts[c.index] = [c.text]
                continue
            self.texts[c.index].append(c.text)
            m.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                if m.logprobs is None:
                    m.logprobs = list(c.logprobs)
                else:
                    m.logprobs.extend(c.logprobs)
            m.cumulative_logprob, m.finish_reason, m.stop_reason = c.cumulative_logprob, c.finish_reason, \
                c.stop_reason
        head = self.head
        if head.prompt_logprobs is None:
            head.prompt_logprobs = out.prompt_logprobs
        head.finished, head.metrics, head.error = out.finished, out.metrics, out.error
        head.num_cached_tokens = out.num_cached_tokens

    def pop(self) -> RequestOutput:
        """The joined output; the joiner is empty again."""
        head, texts = self.head, self.texts
        for c in head.outputs:
            c.text = "".join(texts[c.index])
        self.head, self.texts = None, {}
        return head
