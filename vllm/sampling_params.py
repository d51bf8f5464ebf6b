"""SamplingParams: how one request samples and when it stops (upstream names and defaults)."""
from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field, fields
from typing import Any

from vllm.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5  # temperatures below this sample greedily, as upstream does
MAX_LOGPROBS = 20  # upstream's default --max-logprobs
# torch.Generator.manual_seed takes 64 bits, signed or unsigned.
SEED_RANGE = (-(1 << 63), 1 << 64)
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")
_REQUIRED_INT_FIELDS = ("n", "top_k", "min_tokens")
# Per-request list limits (docs/serving.md). allowed_token_ids and logit_bias become one vector per request when
# it first samples, so their length costs that once; a vocabulary's worth (the largest are ~256K tokens) is the
# most that means anything. The others are walked while the request runs: stop strings at each step's new text,
# bad words (two token sequences each) and stop_token_ids (banned while below min_tokens) at each step.
MAX_TOKEN_ID_LIST = 1 << 18  # allowed_token_ids, logit_bias entries
MAX_STOP_TOKEN_IDS = 1024
MAX_STOP_STRINGS = 64
MAX_BAD_WORDS = 128
REPR_ITEMS = 8  # of a long list in the logged SamplingParams
LENGTH_PENALTY_RANGE = (-10.0, 10.0)  # beam scores divide by length ** length_penalty: finite for any length


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request holds (upstream's names)."""
    CUMULATIVE = 0  # everything so far, every time
    DELTA = 1  # only what is new since the previous output: memory per output stays small
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # -1: the whole vocabulary
    prompt_logprobs: int | None = None  # -1: the whole vocabulary
    logit_bias: dict[int, float] | None = None  # added to the token's logit before sampling (OpenAI's -100..100)
    allowed_token_ids: list[int] | None = None  # sample only among these
    bad_words: list[str] | None = None  # never generated (each word's tokens, with and without a leading space)
    skip_special_tokens: bool = True
    # Upstream's switch for slow tokenizers' decode. With a fast tokenizer (all this engine loads) special tokens
    # are joined without spaces either way, as upstream's fast-tokenizer path does; accepted for its callers.
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # The output follows a JSON schema, regex, choice or grammar (vllm/structured_output); a dict is converted.
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine: eos and stop_token_ids together (min_tokens masks them all).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False, compare=False)
    # Filled by the engine from bad_words: the token sequences the output must never end with.
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False, compare=False)
    # Filled by the sampler when the request first samples: logit_bias and allowed_token_ids as one vector added
    # to its logits (sample/sampler.py `token_bias_vector`), so a step costs the same however long they are.
    token_bias: Any = field(default=None, init=False, repr=False, compare=False)

    def __repr__(self) -> str:
        """The fields that differ from their defaults, long lists cut to their first entries: the server logs this
        per request, and a 200k-entry allowed_token_ids would be a megabyte-long line."""
        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            container = isinstance(value, (list, dict, set))
            if not f.repr or (not value if container else value == f.default):
                continue
            text = repr(value)
            if container and len(value) > REPR_ITEMS:
                head = list(itertools.islice(value.items() if isinstance(value, dict) else value, REPR_ITEMS))
                text = f"<{len(value)} entries, first {head}>"
            shown.append(f"{f.name}={text}")
        return f"SamplingParams({', '.join(shown)})"

    def __post_init__(self) -> None:
        self._check_list_limits()  # first: the checks below walk the lists
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        else:
            self.stop = list(self.stop)
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched on the text)")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        self._validate()
        self._validate_token_maps()
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                    StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams (or a dict of its fields), got "
                             f"{type(self.structured_outputs).__name__}")
        if self.temperature < _GREEDY_EPS:
            # Greedy: the filters are irrelevant; normalise them so batches stay on the fast path.
            self.temperature, self.top_p, self.top_k, self.min_p = 0.0, 1.0, 0, 0.0
        if self.top_k == -1:
            self.top_k = 0
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _check_list_limits(self) -> None:
        for name, limit in (("stop", MAX_STOP_STRINGS), ("stop_token_ids", MAX_STOP_TOKEN_IDS),
                            ("logit_bias", MAX_TOKEN_ID_LIST), ("allowed_token_ids", MAX_TOKEN_ID_LIST),
                            ("bad_words", MAX_BAD_WORDS)):
            value = getattr(self, name)
            if isinstance(value, (list, tuple, dict)) and len(value) > limit:
                raise ValueError(f"{name} must hold at most {limit} entries, got {len(value)}")

    def _validate(self) -> None:
        # Types first, so a wrong-typed value is named instead of failing a comparison below.
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if (value is not None or name in _REQUIRED_INT_FIELDS) and (isinstance(value, bool)
                                                                       or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        checks = [
            (self.n >= 1, "n", self.n, "an integer >= 1"),
            (0.0 <= self.temperature < float("inf"), "temperature", self.temperature, "a finite number >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]"),
            (self.top_k >= -1, "top_k", self.top_k, "an integer >= 0 (0 or -1 disables it; values above the "
             "vocabulary size keep the whole vocabulary)"),
            (0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty, "in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty, "in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty", self.repetition_penalty, "in (0, 10]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", self.max_tokens,
             "an integer >= 1 (or None)"),
            (self.min_tokens >= 0, "min_tokens", self.min_tokens, ">= 0"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
             f"<= max_tokens={self.max_tokens}"),
            (self.logprobs is None or -1 <= self.logprobs <= MAX_LOGPROBS,
             "logprobs", self.logprobs, f"an integer in [0, {MAX_LOGPROBS}], -1 for the whole vocabulary, or None"),
            (self.prompt_logprobs is None or -1 <= self.prompt_logprobs <= MAX_LOGPROBS,
             "prompt_logprobs", self.prompt_logprobs,
             f"an integer in [0, {MAX_LOGPROBS}], -1 for the whole vocabulary, or None"),
            (self.seed is None or SEED_RANGE[0] <= self.seed < SEED_RANGE[1], "seed", self.seed,
             "an integer in [-2**63, 2**64) (or None)"),
        ]
        for ok, name, value, expected in checks:
            if not ok:
                raise ValueError(f"{name} must be {expected}, got {value!r}")

    def _validate_token_maps(self) -> None:
        """logit_bias keys may come as strings (JSON object keys): they become ints here."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
            bias = {}
            for k, v in self.logit_bias.items():
                try:
                    tid = int(k)
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                    raise ValueError(f"logit_bias[{k!r}] must be a number, got {v!r}")
                bias[tid] = float(max(-100.0, min(100.0, v)))  # OpenAI clamps to [-100, 100]
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {ids!r}")
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
                raise ValueError(f"bad_words must be a list of non-blank strings, got {words!r}")
            self.bad_words = list(words) or None

    def token_ids_to_check(self) -> dict[str, list[int]]:
        """The token ids this request names, by field, for the engine to check against the vocabulary."""
        return {"stop_token_ids": self.stop_token_ids, "logit_bias": list(self.logit_bias or ()),
                "allowed_token_ids": self.allowed_token_ids or []}

    @property
    def has_token_bias(self) -> bool:
        return self.logit_bias is not None or self.allowed_token_ids is not None

    @property
    def has_logits_processing(self) -> bool:
        """logit_bias, allowed_token_ids or bad_words: rows the sampler reshapes (and the rejection sampler
        cannot)."""
        return self.logit_bias is not None or self.allowed_token_ids is not None or self.bad_words is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """For `LLM.beam_search` (upstream's fields)."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= 10:
            raise ValueError(f"beam_width must be an integer in [1, 10] (its 2 x width logprobs per step are capped "
                             f"at {MAX_LOGPROBS}), got {self.beam_width!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        lo, hi = LENGTH_PENALTY_RANGE
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp) or not lo <= lp <= hi:
            raise ValueError(f"length_penalty must be a finite number in [{lo:g}, {hi:g}] (beam scores divide by "
                             f"length ** length_penalty), got {lp!r}")
