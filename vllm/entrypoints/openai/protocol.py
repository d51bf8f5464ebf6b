"""OpenAI request bodies as pydantic models, and the error every endpoint answers with.

Known fields parse as upstream's pydantic models do: in pydantic's lax mode, where "5" is 5 and "true" is true
(upstream's own tests send `"logprobs": "true"`). A value that is not one is a 400 that names the field. Unknown
fields are accepted and ignored with a logged warning, as upstream does: clients built for other servers send
extras (`user`, `metadata`, ...). Fields we know but cannot honour (`functions`, structural tags, beam search
with tools) are refused with a 400 saying so, rather than ignored into a different answer.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from vllm.sampling_params import MAX_LOGPROBS, BeamSearchParams, RequestOutputKind, SamplingParams

# A request's seed is a signed 64-bit integer, as upstream's schema bounds it (torch.long's range); the engine
# takes more (n > 1 adds the child index), but clients are held to the range upstream's answers.
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1
# Known to upstream's schema, and not something this engine can do: a 400 naming the reason.
UNSUPPORTED_FIELDS = {
    "functions": "function calling is not supported by this server",
}
# Upstream's older request fields for structured outputs, and the structured_outputs key each one is.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class APIError(Exception):
    """A request that cannot be served: becomes {"error": {...}} with `status`."""

    TYPES: ClassVar[dict[int, str]] = {
        400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
        413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}


def validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as a 400 that names the field (as a dotted path) and what was wrong."""
    err = e.errors(include_url=False)[0]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".") or None
    if err["type"] == "missing":
        return APIError(400, f"field '{param}' is required", param)
    msg = err["msg"].removeprefix("Value error, ")
    got = repr(err.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    if err["type"] != "value_error":  # pydantic's error type too, as upstream's messages carry it
        msg += f", got {got} [type={err['type']}]"
    return APIError(400, f"{param}: {msg}" if param else msg, param)


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, reason in UNSUPPORTED_FIELDS.items():
                if data.get(name) not in (None, [], False):
                    raise ValueError(f"{name}: {reason}")
        return data


def ignored_fields(model: BaseModel, path: str = "") -> list[str]:
    """Dotted paths of the unknown fields in a parsed body (they are ignored; the server logs them)."""
    out = [f"{path}{k}" for k in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(item, BaseModel) and not isinstance(item, ChatMessage):  # a message's extras are used
                out += ignored_fields(item, f"{path}{name}{f'[{i}]' if isinstance(value, list) else ''}.")
    return out


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage in every chunk, not only the last


class JsonSchemaFormat(OpenAIBaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _known_type(self):
        if self.type == "structural_tag":
            raise ValueError("response_format type 'structural_tag' is not supported; use json_schema, json_object "
                             "or structured_outputs")
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format type 'json_schema' needs json_schema.schema")
        return self

    def structured_outputs(self) -> dict | None:
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            return {"json": self.json_schema.schema_}
        return None


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions. None means "the default"."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = Field(1, ge=1, le=128)
    stop: Any = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for abuse tracking: changes no output
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = Field(None, ge=-1, le=MAX_LOGPROBS)
    return_token_ids: bool = False  # the prompt's and each choice's token ids in the response
    return_tokens_as_token_ids: bool | None = None  # logprob tokens as "token_id:N" (default: the server flag)
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # keep only the last N prompt tokens
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vllm/structured_output/params.py's fields
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0  # beam search's: scores are cumulative logprob / length ** length_penalty

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)):
            return v
        raise ValueError(f"must be a string or a list of strings, got {v!r}")

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.use_beam_search and self.structured_outputs_params() is not None:
            raise ValueError("use_beam_search does not combine with structured outputs: the beams are not "
                             "constrained")
        return self

    def structured_outputs_params(self) -> dict | None:
        """The one constraint the request asks for, from response_format, structured_outputs or upstream's
        guided_* fields; ValueError when it asks for several."""
        asked = {name: so for name, so in (
            ("response_format", self.response_format.structured_outputs() if self.response_format else None),
            ("structured_outputs", self.structured_outputs),
            *((f, {key: getattr(self, f)}) for f, key in GUIDED_FIELDS.items() if getattr(self, f) is not None),
        ) if so is not None}
        if len(asked) > 1:
            raise ValueError(f"give one output constraint, got {', '.join(asked)}")
        return next(iter(asked.values()), None)

    def beam_search_params(self, max_tokens: int | None) -> BeamSearchParams:
        """use_beam_search: n beams (upstream's reading of n), greedy unless a temperature is given."""
        if not 1 <= self.n <= 10:
            raise ValueError(f"n must be in [1, 10] with use_beam_search (it is the beam width), got {self.n}")
        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens or 16, ignore_eos=self.ignore_eos,
                                temperature=self.temperature or 0.0, length_penalty=self.length_penalty)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
                        defaults: dict | None = None) -> SamplingParams:
        """SamplingParams validate ranges and raise ValueError naming the field (the server's 400). Outputs are
        DELTA (each new piece once): streams send them on, whole answers join them; the server's latency
        metrics see every step either way. `defaults` (generation_config.json's, as SamplingParams keywords)
        fill the fields the request did not set."""
        optional = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                                  "frequency_penalty", "repetition_penalty")}
        for k, v in (defaults or {}).items():
            if k in optional and k not in self.model_fields_set:
                optional[k] = v
        if "max_tokens" in (defaults or {}) and not {"max_tokens", "max_completion_tokens"} & self.model_fields_set:
            max_tokens = defaults["max_tokens"]
        if self.prompt_logprobs is not None:  # asked for directly, beside what echo needs: the larger
            asked = (self.prompt_logprobs, prompt_logprobs if prompt_logprobs is not None else 0)
            prompt_logprobs = -1 if -1 in asked else max(asked)
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids, seed=self.seed,
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words or None,
            output_kind=RequestOutputKind.DELTA, structured_outputs=self.structured_outputs_params(),
            **{k: v for k, v in optional.items() if v is not None})


class CompletionRequest(SamplingRequest):
    prompt: Any
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> list[str] | list[list[int]]:
        """Always a list of prompts: strings or token-id lists (the four OpenAI shapes)."""
        def is_ids(x):  # bool is not an id; one set of the types: 100K ids took 13 ms as a generator
            return isinstance(x, list) and set(map(type, x)) <= {int}
        if isinstance(v, str) or (is_ids(v) and v):
            v = [v]
        if not isinstance(v, list) or not v:
            raise ValueError("must be a non-empty string, list of strings, list of token ids or list of "
                             "token-id lists")
        if not (all(isinstance(p, str) for p in v) or all(is_ids(p) for p in v)):
            raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id "
                             "lists (not a mix)")
        return v


class TextPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema, passed to the chat template as given
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class ChatMessage(OpenAIBaseModel):
    """Any role (the chat template decides what it means); keys beyond these go to the template as given."""
    role: str
    content: Any = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, v: Any) -> str | None:
        """Text only: a string or a list of {"type": "text", "text": ...} parts, joined; null (an assistant turn
        that only called tools) stays null."""
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list):
            try:
                return "".join(TextPart.model_validate(p).text for p in v)
            except ValidationError:
                pass
        raise ValueError("must be a string or a list of {\"type\": \"text\", \"text\": ...} parts (only text "
                         "content is supported)")


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=-1, le=MAX_LOGPROBS)  # -1: the whole vocabulary
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is left open and continued
    echo: bool = False  # the response starts with the last message's content when its role is the answer's
    chat_template: str | None = None  # a Jinja template for this request (default: the server's)
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template
    tools: list[ChatTool] | None = None
    tool_choice: Any = None  # "none", "auto", "required" or a named function (chat_tools.tool_choice_mode)
    parallel_tool_calls: bool | None = None  # False: a "required" answer holds exactly one call

    @model_validator(mode="after")
    def _chat_fields(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.use_beam_search and self.tools and self.tool_choice != "none":
            raise ValueError("use_beam_search does not combine with tools: the beams are answered as text")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message continues the last message, so add_generation_prompt must "
                             "be false")
        return self


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # The tokenizer's special tokens (BOS) around the text: by default on for a prompt and off for messages (the
    # chat template writes its own), as upstream's /tokenize does.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None  # rendered by the chat template, as for a chat completion
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]
