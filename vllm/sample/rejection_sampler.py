"""Rejection sampler: verifies speculative drafts over ragged rows (upstream standard speculative sampling).

Request r verifies its own number of drafts n_r (0..K). Its target logits rows are ``cu_num_logits[r]:cu_num_logits[r+1]``:
one row per draft position, then one bonus row. Per request the output row holds the accepted drafts, then exactly one
more token (the recovered token at the first rejection, or the bonus token when every draft was accepted), padded
with -1 to K+1 columns.

Greedy rows (temperature 0): draft j is accepted iff it equals the argmax of target row j; the first mismatch emits
that row's argmax; all accepted emits the bonus row's argmax. So greedy verification is lossless.

Random rows: p = softmax of the target logits after temperature -> min-p -> top-k/top-p, exactly the chain of
``Sampler``'s random path (its helpers are reused). q = the draft distribution (``draft_probs``: [num_drafts, V] flat,
or [B, K, V] per request and position), or the one-hot of the draft when ``draft_probs`` is None (ngram and greedy
DSpark drafts are deterministic). Draft x is accepted with probability
min(1, p(x)/q(x)); at the first rejection the token is drawn from max(p - q, 0) (renormalised); when every draft was
accepted the bonus token is drawn from p of the bonus row. Each emitted token is then distributed exactly as p.

Placeholder drafts (-1) are always rejected. Their q is taken as zero, so a random row draws the token at that
position from p itself, and a greedy row emits the target argmax there.

Out of scope (documented, not silently approximated elsewhere): penalties (presence/frequency/repetition) and banned
ids (min_tokens) are NOT applied here - the per-position output history differs along a draft, so a caller that
needs them must apply them to ``target_logits`` per row before calling. Logprobs are not produced.

Lengths are read from the DEVICE offsets ``cu_num_logits`` (under adaptive verification the device lengths may differ
from the host list, see spec_decode_and_graphs.md), so the whole pass makes no device->host sync. The host list
``num_draft_tokens`` only gives the output width (``max_spec_len`` overrides it: pass the promised bound, e.g.
num_speculative_tokens, when device lengths may exceed the host ones) and the number of uniforms a seeded row draws.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.core.sentinels import PLACEHOLDER_TOKEN_ID
from vllm.sample.sampler import SamplingMetadata, apply_min_p, apply_top_k_top_p, exponential_race


@dataclass(slots=True)
class SpecDecodeMetadata:
    draft_token_ids: torch.Tensor  # [num_draft_total] int64, flattened over requests; -1 marks a placeholder
    num_draft_tokens: list[int]  # per request (0..K), CPU
    cu_num_logits: torch.Tensor  # device int32 [B+1]: request r's target rows are cu[r]:cu[r+1] (drafts + 1 bonus)

    @classmethod
    def from_drafts(cls, drafts: list[list[int]], device: torch.device | str) -> SpecDecodeMetadata:
        """Convenience builder from per-request draft lists (tests, simple callers)."""
        counts = [len(d) for d in drafts]
        flat = [t for d in drafts for t in d]
        cu = [0]
        for c in counts:
            cu.append(cu[-1] + c + 1)
        return cls(torch.tensor(flat, dtype=torch.int64, device=device), counts,
                   torch.tensor(cu, dtype=torch.int32, device=device))


def num_accepted(output: torch.Tensor) -> torch.Tensor:
    """[B] int64 accepted drafts per request: tokens before the first -1, minus the one recovered/bonus token."""
    return (output != PLACEHOLDER_TOKEN_ID).sum(-1) - 1


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Sampler's random-path processing, per logits row (greedy rows ride along at temperature 1)."""
    temperature = torch.where(temperature == 0, 1.0, temperature)
    logits = logits / temperature.unsqueeze(1)
    if not meta.no_min_p:
        logits = apply_min_p(logits, min_p)
    if not meta.no_top_k_top_p:
        logits = apply_top_k_top_p(logits, top_k, top_p)
    return logits.softmax(-1)


def greedy_verify(target_argmax: torch.Tensor, draft_ids: torch.Tensor, query_start_loc: torch.Tensor,
                  max_spec_len: int) -> torch.Tensor:
    """Greedy verification of a step whose every token is a logits row (a decode or verify step): row r's tokens
    are query_start_loc[r]:query_start_loc[r+1], its current token then its drafts. Returns [R, max_spec_len + 1]
    as RejectionSampler does for greedy rows: accepted drafts, then the target's argmax at the first rejection
    (or the bonus row), padded with -1. A row of no tokens (graph padding) gives garbage in its first column.

    Every shape follows the inputs' (no host value, no data-dependent size), so it runs inside a CUDA graph:
    target_argmax [T] and draft_ids [T] (placeholders -1, never accepted) may be padded past the step's tokens."""
    K, last = max_spec_len, target_argmax.shape[0] - 1
    start = query_start_loc[:-1].long()
    num_drafts = query_start_loc[1:].long() - start - 1  # [R]; -1 for a padding row
    cols = torch.arange(K + 1, device=target_argmax.device)
    target = target_argmax[(start[:, None] + cols).clamp(max=last)]  # [R, K + 1]: argmax at each row position
    drafts = draft_ids[(start[:, None] + 1 + cols[:K]).clamp(max=last)]  # [R, K]: draft j is row token j + 1
    match = (drafts == target[:, :K]) & (cols[:K] < num_drafts[:, None])
    accepted = match.to(torch.int64).cumprod(1).sum(1, keepdim=True)  # [R, 1]
    out = torch.where(cols[:K] < accepted, drafts, PLACEHOLDER_TOKEN_ID)
    out = torch.cat([out, out.new_full((out.shape[0], 1), PLACEHOLDER_TOKEN_ID)], dim=1)
    return out.scatter_(1, accepted, target.gather(1, accepted))


class RejectionSampler:
    """Never writes into the caller's tensors. Returns [B, max_spec_len + 1] int64, padded with -1."""

    num_accepted = staticmethod(num_accepted)

    def __call__(self, target_logits: torch.Tensor, draft_probs: torch.Tensor | None, meta: SpecDecodeMetadata,
                 sampling: SamplingMetadata, max_spec_len: int | None = None) -> torch.Tensor:
        device = target_logits.device
        num_reqs = len(meta.num_draft_tokens)
        width = max(meta.num_draft_tokens, default=0) if max_spec_len is None else max_spec_len
        num_rows = target_logits.shape[0]
        draft_ids = meta.draft_token_ids.to(torch.int64)
        num_drafts = draft_ids.shape[0]

        # Ragged layout, from device offsets only (no sync).
        cu = meta.cu_num_logits.to(torch.int64)
        row_start = cu[:-1]  # [B] first logits row of each request
        n = (cu[1:] - row_start - 1).clamp_min(0)  # [B] drafts per request (device truth)
        req_idx = torch.arange(num_reqs, device=device)
        draft_start = row_start - req_idx  # [B] first flat draft index of each request
        draft_end = cu[1:] - req_idx - 1
        flat = torch.arange(num_drafts, device=device)
        req_of_draft = torch.searchsorted(draft_end, flat, right=True).clamp_(max=max(num_reqs - 1, 0))
        pos_of_draft = flat - draft_start[req_of_draft]  # position of the draft inside its request
        row_of_draft = flat + req_of_draft  # its target logits row

        greedy_req = sampling.temperature == 0  # [B]
        target_argmax = target_logits.argmax(-1)  # [N]

        # Per-draft acceptance, flat [D].
        accept = draft_ids == target_argmax[row_of_draft]  # greedy rule; a placeholder never equals an argmax
        probs = None
        if not sampling.all_greedy:
            req_of_row = torch.searchsorted(cu[1:], torch.arange(num_rows, device=device), right=True)
            req_of_row.clamp_(max=max(num_reqs - 1, 0))  # rows past cu[-1] (padding) borrow the last request's params
            probs = target_probs(target_logits, sampling.temperature[req_of_row], sampling.min_p[req_of_row],
                                 sampling.top_k[req_of_row], sampling.top_p[req_of_row], sampling)
            if num_drafts:
                safe_ids = draft_ids.clamp_min(0)
                p_x = probs[row_of_draft, safe_ids]  # [D], no [D, V] copy
                if draft_probs is None:
                    q_x = torch.ones_like(p_x)
                elif draft_probs.dim() == 3:  # per request and position: [B, >= width, V]
                    q_x = draft_probs[req_of_draft, pos_of_draft.clamp(max=draft_probs.shape[1] - 1),
                                      safe_ids].float()
                else:
                    q_x = draft_probs[flat, safe_ids].float()
                uniforms = self._uniforms(num_reqs, width, meta.num_draft_tokens, sampling.generators, device)
                u = uniforms[req_of_draft, pos_of_draft.clamp(max=uniforms.shape[1] - 1)]
                # u in [0, 1): P(u * q < p) = min(1, p / q), and p(x) = 0 is never accepted.
                accept_random = (u * q_x < p_x) & (q_x > 0)
                accept = torch.where(greedy_req[req_of_draft], accept, accept_random)
        accept &= draft_ids != PLACEHOLDER_TOKEN_ID

        # Scatter into the padded [B, width] layout; column `width` is a dump for drafts beyond the bound.
        pos_c = pos_of_draft.clamp(max=width)
        drafts_pad = torch.full((num_reqs, width + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
        accept_pad = torch.zeros((num_reqs, width + 1), dtype=torch.bool, device=device)
        drafts_pad[req_of_draft, pos_c] = draft_ids
        accept_pad[req_of_draft, pos_c] = accept
        accept_pad[:, width] = False
        # Accepted = length of the all-accepted prefix.
        a = accept_pad.to(torch.int64).cumprod(1).sum(1)  # [B], <= min(n, width)

        # The one extra token always comes from logits row row_start + a: recovered (a < n) or bonus (a == n).
        final_row = (row_start + a).clamp(max=max(num_rows - 1, 0))
        final = target_argmax[final_row]
        if probs is not None:
            p_final = probs[final_row]
            recovered = a < n
            a_c = a.clamp(max=width).unsqueeze(1)
            draft_at_a = drafts_pad.gather(1, a_c).squeeze(1)
            use_q = recovered & (draft_at_a != PLACEHOLDER_TOKEN_ID)  # placeholders: q = 0, sample from p
            if num_drafts == 0:
                residual = p_final
            elif draft_probs is None:
                q_final = torch.zeros_like(p_final)
                q_final.scatter_(1, draft_at_a.clamp_min(0).unsqueeze(1), use_q.to(p_final.dtype).unsqueeze(1))
                residual = (p_final - q_final).clamp_min(0)
            elif draft_probs.dim() == 3:
                q_final = draft_probs[req_idx, a.clamp(max=draft_probs.shape[1] - 1)].float() * use_q.unsqueeze(1)
                residual = (p_final - q_final).clamp_min(0)
            else:
                q_idx = (draft_start + a).clamp(max=num_drafts - 1)
                q_final = draft_probs[q_idx].float() * use_q.unsqueeze(1)
                residual = (p_final - q_final).clamp_min(0)
            # Rejection has zero probability when p == q; if float error leaves nothing, fall back to p.
            empty = residual.sum(-1, keepdim=True) <= 0
            residual = torch.where(empty, p_final, residual)
            final = torch.where(greedy_req, final, exponential_race(residual, sampling.generators))

        cols = torch.arange(width + 1, device=device)
        out = torch.where(cols < a.unsqueeze(1), drafts_pad, PLACEHOLDER_TOKEN_ID)
        out.scatter_(1, a.clamp(max=width).unsqueeze(1), final.unsqueeze(1))
        return out

    @staticmethod
    def _uniforms(num_reqs: int, width: int, num_draft_tokens: list[int],
                  generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
        """[B, max(width,1)] uniforms in [0, 1). A seeded row draws exactly its host draft count from its own
        generator (then the exponential race draws V more), so its stream does not depend on the batch. This is the
        one per-request Python loop: torch has no batched draw from a list of generators. (Positions beyond a seeded
        row's host count, possible only when device lengths exceed host ones, keep default-RNG uniforms.)"""
        u = torch.rand(num_reqs, max(width, 1), device=device)
        for r, g in enumerate(generators):
            if g is not None:
                c = min(num_draft_tokens[r], width)
                if c:
                    u[r, :c] = torch.rand(c, generator=g, device=device)
        return u
