"""The sampler for one engine step (upstream vLLM v1 semantics), one row per request that samples this step.

Order: the grammar's mask (structured outputs) -> banned ids -> penalties -> greedy rows take the argmax; random
rows: temperature -> min-p -> top-k -> top-p -> exponential race. Logprobs come from the raw logits, before
all of that but the grammar's mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.sample.grammar_bitmask import GrammarBitmask, apply_grammar_bitmask
from vllm.sampling_params import SamplingParams
from vllm.utils import async_tensor_h2d

_COLUMNS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@dataclass(slots=True)
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32; 0: greedy
    top_k: torch.Tensor  # [B] int64; 0: off
    top_p: torch.Tensor  # [B] float32; 1: off
    min_p: torch.Tensor  # [B] float32; 0: off
    presence_penalty: torch.Tensor  # [B] float32
    frequency_penalty: torch.Tensor  # [B] float32
    repetition_penalty: torch.Tensor  # [B] float32; 1: off
    generators: list[torch.Generator | None]  # a seeded row's own generator, on the logits' device
    # Penalties (None when no row has one): each row's output-token counts [B, V] float32 and prompt-token
    # marks [B, V] bool, from the engine's device-side store (sample/penalties.py).
    output_counts: torch.Tensor | None
    prompt_seen: torch.Tensor | None
    banned_token_ids: list[list[int]]  # e.g. stop/eos ids while below min_tokens
    max_num_logprobs: int | None  # None: no row wants logprobs; -1: a row wants the whole vocabulary
    # Host-side flags let a step skip whole passes without reading the device tensors back. The defaults are
    # the safe ones: with off values a pass changes nothing, it only costs time.
    all_greedy: bool
    no_penalties: bool
    no_min_p: bool = False
    no_top_k_top_p: bool = False
    # The rows with logit_bias or allowed_token_ids and their params (None when no row has any). Their vectors
    # are stacked once per metadata (`token_bias`), so a reused metadata costs nothing more per step.
    token_bias_rows: list[int] | None = None
    token_bias_params: list[SamplingParams] | None = None
    _token_bias: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def argmax_only(self) -> bool:
        """Every row's token is its logits' argmax, and nothing else is asked of the logits (no penalty, ban,
        bias or logprobs): what Sampler would return is the argmax itself."""
        return (self.all_greedy and self.no_penalties and self.max_num_logprobs is None
                and self.token_bias_rows is None and not any(self.banned_token_ids))

    def token_bias(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the biased rows' indices, their bias vectors [rows, V]) on the logits' device, built on first use."""
        if self._token_bias is None:
            vocab, device = logits.shape[1], logits.device
            vectors = [token_bias_vector(p, vocab, device, logits.dtype) for p in self.token_bias_params]
            self._token_bias = (async_tensor_h2d(self.token_bias_rows, torch.int64, device), torch.stack(vectors))
        return self._token_bias

    @classmethod
    def from_requests(cls, params: list[SamplingParams], generators: list[torch.Generator | None],
                      banned_token_ids: list[list[int]], device: torch.device | str,
                      penalty_counts: tuple[torch.Tensor, torch.Tensor] | None = None) -> SamplingMetadata:
        """`penalty_counts`: (output counts, prompt marks) for the rows, needed when any row has a penalty."""
        rows = {"generators": generators, "banned_token_ids": banned_token_ids}
        for name, value in rows.items():
            if len(value) != len(params):
                raise ValueError(f"{name} has {len(value)} rows but there are {len(params)} SamplingParams; "
                                 "pass one entry per sampling request, in the same order")
        no_penalties = not any(p.has_penalties for p in params)
        if not no_penalties and penalty_counts is None:
            raise ValueError("a row has a penalty: pass its token counts (penalty_counts, see sample/penalties.py)")

        # One queued upload for every column (separate torch.tensor(..., device=cuda) calls each block the host
        # until the GPU catches up). top_k rides as float32: exact, since it is clamped to the vocabulary.
        columns = async_tensor_h2d([[getattr(p, attr) for attr in _COLUMNS] for p in params], torch.float32,
                                   device).view(len(params), len(_COLUMNS)).t()
        col = dict(zip(_COLUMNS, columns))
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        biased = [i for i, p in enumerate(params) if p.has_token_bias]
        return cls(
            temperature=col["temperature"],
            top_k=col["top_k"].long(),
            top_p=col["top_p"],
            min_p=col["min_p"],
            presence_penalty=col["presence_penalty"],
            frequency_penalty=col["frequency_penalty"],
            repetition_penalty=col["repetition_penalty"],
            generators=list(generators),
            output_counts=None if no_penalties else penalty_counts[0],
            prompt_seen=None if no_penalties else penalty_counts[1],
            banned_token_ids=banned_token_ids,
            max_num_logprobs=(-1 if -1 in wanted else max(wanted)) if wanted else None,
            all_greedy=all(p.greedy for p in params),
            no_penalties=no_penalties,
            no_min_p=all(p.min_p == 0 for p in params),
            no_top_k_top_p=all(p.top_k == 0 and p.top_p == 1 for p in params),
            token_bias_rows=biased or None,
            token_bias_params=[params[i] for i in biased] or None,
        )


@dataclass(slots=True)
class LogprobsTensors:
    token_ids: torch.Tensor  # [N, k+1] int64: column 0 the chosen/target token, then the top-k ids
    logprobs: torch.Tensor  # [N, k+1] float32
    ranks: torch.Tensor  # [N] int64: rank of the column-0 token (1 = most likely)


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None


class Sampler:
    """Never writes into the caller's logits: the runner may still need them (e.g. for prompt logprobs)."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata,
                 grammar: GrammarBitmask | None = None) -> SamplerOutput:
        if grammar is not None:  # before logprobs, as upstream: they are the constrained distribution's
            logits = apply_grammar_bitmask(logits, grammar)
        # Users ask for the model's own distribution, so logprobs ignore penalties and filters (upstream's
        # default "raw_logprobs").
        raw_logprobs = logits.log_softmax(-1) if meta.max_num_logprobs is not None else None
        if any(meta.banned_token_ids):
            logits = logits.masked_fill(token_counts(meta.banned_token_ids, logits) > 0, float("-inf"))
        if meta.token_bias_rows is not None:
            rows, bias = meta.token_bias(logits)
            logits = logits.index_add(0, rows, bias)
        if not meta.no_penalties:
            logits = apply_penalties(logits, meta)
        sampled = logits.argmax(-1)
        if not meta.all_greedy:
            sampled = torch.where(meta.temperature == 0, sampled, sample_random(logits, meta))
        logprobs = None
        if raw_logprobs is not None:
            k = meta.max_num_logprobs
            logprobs = gather_logprobs(raw_logprobs, sampled, logits.shape[1] if k == -1 else k)
        return SamplerOutput(sampled, logprobs)


def token_counts(rows: list[list[int]], logits: torch.Tensor) -> torch.Tensor:
    """[B, V] float32 count of each token id in each row, on the logits' device. Host work is the ids
    themselves: a long row costs only its own request, not every row padded to it."""
    num_rows, vocab_size = logits.shape
    index = async_tensor_h2d([[r for r, ids in enumerate(rows) for _ in ids], [t for ids in rows for t in ids]],
                             torch.int64, logits.device)
    counts = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=logits.device)
    counts.index_put_((index[0], index[1]), torch.ones(index.shape[1], device=logits.device), accumulate=True)
    return counts


def token_bias_vector(params: SamplingParams, vocab_size: int, device: torch.device,
                      dtype: torch.dtype) -> torch.Tensor:
    """The request's logit_bias added, and -inf outside its allowed_token_ids, as one [V] vector to add to its
    logits; built from the lists once and kept on the params (a request's params outlive its steps)."""
    cached = params.token_bias
    if cached is not None and cached.shape[0] == vocab_size and cached.device == device and cached.dtype == dtype:
        return cached
    if params.allowed_token_ids is not None:
        vector = torch.full((vocab_size,), float("-inf"), dtype=dtype, device=device)
        vector.index_fill_(0, async_tensor_h2d(params.allowed_token_ids, torch.int64, device), 0.0)
    else:
        vector = torch.zeros(vocab_size, dtype=dtype, device=device)
    if params.logit_bias:
        # -inf + bias stays -inf: a bias on a token that is not allowed changes nothing, as before.
        vector.index_put_((async_tensor_h2d(list(params.logit_bias), torch.int64, device),),
                          async_tensor_h2d(list(params.logit_bias.values()), dtype, device), accumulate=True)
    params.token_bias = vector
    return vector


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition over prompt and output tokens, then presence and frequency over output tokens only."""
    counts = meta.output_counts
    in_output = counts > 0
    seen = in_output | meta.prompt_seen
    rep = meta.repetition_penalty.unsqueeze(1)
    # Dividing a positive logit and multiplying a negative one both lower it when the penalty is > 1.
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - meta.frequency_penalty.unsqueeze(1) * counts - meta.presence_penalty.unsqueeze(1) * in_output


def sample_random(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """A token for every row as if none were greedy; the caller keeps the argmax for greedy rows."""
    # Greedy rows ride along at temperature 1: dividing by their 0 would fill them with inf/NaN.
    temperature = torch.where(meta.temperature == 0, 1.0, meta.temperature)
    logits = logits / temperature.unsqueeze(1)
    if not meta.no_min_p:
        logits = apply_min_p(logits, meta.min_p)
    if not meta.no_top_k_top_p:
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    return exponential_race(logits.softmax(-1), meta.generators)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens whose probability is below min_p times the top token's."""
    probs = logits.softmax(-1)
    drop = probs < min_p.unsqueeze(1) * probs.amax(-1, keepdim=True)
    return logits.masked_fill(drop, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k, then top-p over the renormalised survivors, with one ascending sort of the whole batch."""
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1)
    k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)
    # A threshold rather than a count: ties with the k-th value survive, as upstream.
    kth = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    # Ascending, a token is dropped when it and everything below it hold at most 1 - p, which leaves the
    # smallest top set holding at least p.
    drop = sorted_logits.softmax(-1).cumsum(-1) <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False  # float error must never empty a row
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """argmax(p / q) with q ~ Exp(1) picks token i with probability p_i (the smallest of independent Exp(p_i)
    variables is the i-th with probability p_i / sum p), in one pass with no cumulative sum. A seeded row draws
    its q from its own generator, so its tokens do not depend on the rest of the batch."""
    q = torch.empty_like(probs)
    if any(g is None for g in generators):
        q.exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            q[row].exponential_(generator=generator)
    # exponential_ may return exactly 0; a masked token would then score 0/0 = NaN, and argmax picks NaN.
    return (probs / q.clamp_min_(torch.finfo(q.dtype).tiny)).argmax(-1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Column 0: each row's token_ids entry (sampled or prompt target); then the row's top k, most likely first."""
    token_ids = token_ids.long().unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    # Counting >= includes the token itself, so the top token has rank 1 (ties share the worse rank, as upstream).
    ranks = (logprobs >= token_logprobs).sum(-1)
    return LogprobsTensors(torch.cat([token_ids, top_ids], 1), torch.cat([token_logprobs, top_logprobs], 1), ranks)
