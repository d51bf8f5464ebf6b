"""SpeculativeConfig: `--speculative-config` (ngram or DSpark drafts, adaptive verification)."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.config.utils import is_int, parse_json, require, short_repr
from vllm.transformers_utils.configs.dspark import DSparkConfig, read_dspark_config

SPEC_METHODS_BUILT = ("ngram", "dspark")
SPEC_CONFIG_KEYS = {"ngram": ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"),
                    "dspark": ("method", "num_speculative_tokens", "model", "draft_sample_method",
                               "enable_adaptive_verification")}
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
NGRAM_DEFAULT_PROMPT_LOOKUP_MIN = 1
NGRAM_DEFAULT_PROMPT_LOOKUP_MAX = 4
# Each request owns 1 + K full KDA recurrent states for its whole life (the checkpoint-slot design,
# docs/spec_decode.md) and the native KDA decode kernel unrolls its token loop to 1 + K, so K must stay small;
# acceptance compounds per position, so drafts past a few dozen are never accepted anyway.
MAX_NUM_SPECULATIVE_TOKENS = 32


@dataclass(slots=True)
class SpeculativeConfig:
    """`--speculative-config '{"method": "ngram" | "dspark", "num_speculative_tokens": K, ...}'`.

    ngram (prompt lookup): propose up to `num_speculative_tokens` tokens that followed an earlier occurrence of the
    longest suffix n-gram with prompt_lookup_min <= n <= prompt_lookup_max. Defaults differ from upstream on purpose:
    upstream sets min = max = 5 when both are absent and copies one into the other when only one is given; here an
    absent prompt_lookup_min is 1 and an absent prompt_lookup_max is max(4, prompt_lookup_min), so short repeats
    still draft.

    dspark: a DSpark draft checkpoint (`model`, a directory) drafts K tokens per decoding request on the device,
    from the target's hidden states (docs/spec_decode.md). draft_sample_method "greedy" (argmax drafts: exact under
    the rejection sampler for greedy and random requests alike) or "probabilistic" (a random request's drafts are
    sampled from the draft's distribution at the request's temperature, which the rejection sampler then takes
    as q: more drafts accepted where the target is not peaked; greedy requests still draft the argmax).
    enable_adaptive_verification: each all-verify step verifies only the draft tokens worth their cost
    (vllm/spec_decode/adaptive_verification/).
    """
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    draft_sample_method: str = "greedy"
    enable_adaptive_verification: bool = False
    draft_config: DSparkConfig | None = field(default=None, repr=False)  # read from `model` (dspark)

    def __post_init__(self) -> None:
        flag = "--speculative-config"
        require(self.method in SPEC_METHODS_BUILT, f"{flag} method", self.method,
                 f"one of {', '.join(map(repr, SPEC_METHODS_BUILT))}")
        require(is_int(self.num_speculative_tokens)
                 and 1 <= self.num_speculative_tokens <= MAX_NUM_SPECULATIVE_TOKENS,
                 f"{flag} num_speculative_tokens", self.num_speculative_tokens,
                 f"an integer in [1, {MAX_NUM_SPECULATIVE_TOKENS}] (each request keeps 1 + K KDA state checkpoints)")
        if self.method == "dspark":
            self._check_dspark(flag)
            return
        if self.prompt_lookup_min is None:
            self.prompt_lookup_min = NGRAM_DEFAULT_PROMPT_LOOKUP_MIN
        require(is_int(self.prompt_lookup_min) and self.prompt_lookup_min >= 1,
                 f"{flag} prompt_lookup_min", self.prompt_lookup_min, "an integer >= 1")
        if self.prompt_lookup_max is None:
            self.prompt_lookup_max = max(NGRAM_DEFAULT_PROMPT_LOOKUP_MAX, self.prompt_lookup_min)
        require(is_int(self.prompt_lookup_max) and self.prompt_lookup_max >= self.prompt_lookup_min,
                 f"{flag} prompt_lookup_max", self.prompt_lookup_max,
                 f"an integer >= prompt_lookup_min={self.prompt_lookup_min}")

    def _check_dspark(self, flag: str) -> None:
        require(isinstance(self.model, str) and self.model, f"{flag} model", self.model,
                 "the directory of a DSpark draft checkpoint (method 'dspark' needs one)")
        require(self.draft_sample_method in DRAFT_SAMPLE_METHODS, f"{flag} draft_sample_method",
                 self.draft_sample_method, f"one of {', '.join(map(repr, DRAFT_SAMPLE_METHODS))}")
        require(isinstance(self.enable_adaptive_verification, bool), f"{flag} enable_adaptive_verification",
                 self.enable_adaptive_verification, "true or false")
        self.draft_config = read_dspark_config(self.model)

    @classmethod
    def from_json(cls, text_or_dict: str | dict) -> SpeculativeConfig:
        """Build from the `--speculative-config` JSON text or an already-parsed dict."""
        flag = "--speculative-config"
        if isinstance(text_or_dict, str):
            try:
                data = parse_json(text_or_dict)
            except ValueError as e:
                raise ValueError(f"{flag}={short_repr(text_or_dict)} is not valid JSON: {e}") from None
        else:
            data = text_or_dict
        require(isinstance(data, dict), flag, text_or_dict, 'a JSON object such as {"method": "ngram", '
                 '"num_speculative_tokens": 3}')
        require("method" in data, flag, data, f"a 'method' key (one of {', '.join(map(repr, SPEC_METHODS_BUILT))})")
        require(data["method"] in SPEC_CONFIG_KEYS, f"{flag} method", data["method"],
                 f"one of {', '.join(map(repr, SPEC_METHODS_BUILT))}")
        keys = SPEC_CONFIG_KEYS[data["method"]]
        unknown = sorted(k for k in data if k not in keys)
        require(not unknown, f"{flag} keys", unknown, f"for method {data['method']!r} only the keys {', '.join(keys)}")
        require("num_speculative_tokens" in data, flag, data, "a 'num_speculative_tokens' key (an integer >= 1)")
        return cls(**data)
