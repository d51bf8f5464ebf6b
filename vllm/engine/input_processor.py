"""InputProcessor (upstream's name): a request's admission. The prompt is tokenized and checked against the
vocabulary, the sampling params against the model, max_tokens against --max-model-len, and a request with n > 1
becomes n child Requests (seeded children get seed + index, so the n samples differ but stay reproducible).
Everything here raises ValueError naming what was wrong, before the scheduler sees the request."""
from __future__ import annotations

import dataclasses
import time

import torch

from vllm.core.request import Request
from vllm.inputs import PromptType
from vllm.inputs.validation import prompt_problem, text_problem
from vllm.sample.bad_words import bad_words_token_ids
from vllm.sampling_params import SamplingParams
from vllm.spec_decode.metrics import SpecDecodeStats


def checked_max_tokens(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """A request's max_tokens (None: up to --max-model-len) once the prompt and it are known to fit; raises
    ValueError otherwise. Beam search checks its whole search with it too (vllm/beam_search.py)."""
    if num_prompt_tokens >= max_model_len:
        raise ValueError(f"the prompt has {num_prompt_tokens} tokens but --max-model-len is {max_model_len}: it must "
                         "be at most max_model_len - 1 so that at least one token can be generated")
    if max_tokens is None:
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + max_tokens > max_model_len:
        raise ValueError(f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds "
                         f"--max-model-len ({max_model_len})")
    return max_tokens


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int], max_model_len: int,
                 device: torch.device, num_spec: int) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self.max_model_len, self.device, self.num_spec = max_model_len, device, num_spec

    def process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """The prompt's text (None when given as ids) and token ids."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt and "prompt" not in prompt:
                raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
            text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
        else:
            raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
        if (problem := text_problem(text)) is not None:  # before the tokenizer, which raises TypeError on it
            raise ValueError(problem)
        if ids is None:
            ids = self.tokenizer.encode(text)
        problem = prompt_problem(ids, self.vocab_size, text)
        if problem is not None:
            raise ValueError(problem)
        return text, ids

    def checked_params(self, params: SamplingParams) -> SamplingParams:
        """What SamplingParams cannot check alone, against this model: raises ValueError naming the field, and
        clamps top_k to the vocabulary as upstream does (a copy, so the caller's object is unchanged)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}"
                             + ("; build one with SamplingParams(**your_dict)" if isinstance(params, dict) else ""))
        V = self.vocab_size
        for name, ids in params.token_ids_to_check().items():
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise ValueError(f"{name} hold ids outside the vocabulary [0, {V}): {bad[:5]}")
        if params.top_k > V:
            params = dataclasses.replace(params, top_k=V)
        if params.bad_words:
            params = dataclasses.replace(params, bad_words_token_ids=bad_words_token_ids(self.tokenizer,
                                                                                         params.bad_words))
        return params

    def can_speculate(self, params: SamplingParams) -> bool:
        """Drafts are verified by the rejection sampler, which applies no penalties, min_tokens bans, logit
        biases or logprobs: requests asking for those decode one token per step."""
        return self.num_spec > 0 and params.logprobs is None and params.prompt_logprobs is None \
            and params.min_tokens == 0 and not params.has_penalties and not params.has_logits_processing \
            and params.structured_outputs is None  # drafts are not checked against the grammar

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams,
                arrival_time: float | None = None) -> tuple[str | None, list[int], SamplingParams, list[Request]]:
        """The request checked: its prompt text and ids, its checked params and its n child Requests."""
        params = self.checked_params(params)
        text, ids = self.process_prompt(prompt)
        max_tokens = checked_max_tokens(len(ids), params.max_tokens, self.max_model_len)
        children = []
        for i in range(params.n):
            child_params = params if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i)
            child_params.all_stop_token_ids = set(child_params.stop_token_ids)
            generator = None
            if child_params.seed is not None:
                generator = torch.Generator(self.device).manual_seed(child_params.seed)
            children.append(Request(request_id if params.n == 1 else f"{request_id}-{i}", ids, child_params,
                                    max_tokens, self.eos_token_ids, arrival_time or time.monotonic(),
                                    generator=generator, speculate=self.can_speculate(child_params),
                                    spec_stats=SpecDecodeStats(self.num_spec) if self.num_spec else None))
        return text, ids, params, children
