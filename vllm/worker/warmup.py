"""The eager step shapes a CUDA start-up runs once, so that Triton compiles what serving's eager steps need
before the first request rather than in the middle of one.

A Triton kernel compiles once per combination of its constexprs, and the host picks several of them from the
step's shape. The CUDA graphs' captures compile the decode kernels, and the profile run one long prompt; a
mixed step (prompt chunks beside decode rows) runs eagerly, and in a served run its first occurrence of each
variant stalled every stream for 0.3-1.3 s (`CompileWatch`'s log on the H200). The host's choices there:
- TRITON_MLA: the absorbed rows' tile family, from their longest row times the heads (<= 16, <= 32, more
  rows); prompt chunks longer than `short_chunk` run unabsorbed beside them (the kernel's skip variant); one
  split (prompt chunks present, or a short context) or several (then the merge);
- the triton KDA backend: fla's recurrent kernel for steps of chunks up to `recurrent_chunk` tokens, chunk_kda
  past it; the conv's two tile heights;
- the fused MoE's tile buckets, by routed pairs per expert (decode-sized, mid, prompt-sized);
- the native KDA decode's programs per head (1, 2 or 4, from decode rows x heads against the SM count): the
  eager decode steps of 1, 2, 4, .. rows cross each threshold, as the graphs' captures do for graph batches.
The steps below cross each of these once; integer arguments that change every step are not specialised by
the kernels (`do_not_specialize`), so a token count never makes a variant. CompileWatch names any compile
that still happens after start-up.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WarmupStep:
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]  # tokens already cached before the step, per row
    prefilling: tuple[bool, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


# The chunk lengths the steps are built around where a backend declares no switch: the other choices above
# (tile families, MoE buckets, splits) still need short and mid-sized prompt chunks.
DEFAULT_SHORT_CHUNK, DEFAULT_RECURRENT_CHUNK = 16, 256


def eager_warmup_steps(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                       short_chunk: int | None, recurrent_chunk: int | None) -> list[WarmupStep]:
    """The warm-up steps that fit the scheduler's bounds, without repeats. `short_chunk`: the MLA backend's
    unabsorbed-prefill threshold; `recurrent_chunk`: the KDA prefill backend's recurrent-kernel bound (None:
    the backend has none)."""
    short_chunk = DEFAULT_SHORT_CHUNK if short_chunk is None else short_chunk
    recurrent_chunk = DEFAULT_RECURRENT_CHUNK if recurrent_chunk is None else recurrent_chunk
    rows: list[list[tuple[int, int, bool]]] = []  # (query len, context len, prefilling) per row
    num_decode = max(0, min(max_num_seqs - 2, 32))
    context = min(max_model_len - 1, 2048)  # several MLA splits for the decode rows
    decode = [(1, context, False)] * num_decode
    chunk = min(recurrent_chunk, max_num_batched_tokens - num_decode - short_chunk)
    for short in sorted({1, 2, 3, short_chunk}):  # absorbed prompt rows of each tile family
        rows += [[(short, 0, True)], decode + [(short, 0, True)], decode + [(short, 0, True), (chunk, 0, True)]]
    rows.append(decode + [(chunk, 0, True)])  # an unabsorbed chunk beside decode rows: the skip variant
    rows.append([(chunk, 0, True)] * min(max_num_seqs, max_num_batched_tokens // max(chunk, 1)))  # recurrent
    long_chunk = min(max_num_batched_tokens - num_decode, max_model_len)
    rows.append(decode + [(long_chunk, 0, True)])  # chunk_kda beside decode rows
    cached = max_model_len // 2  # a continued prompt: chunk_kda from a state, MLA over a context
    rows.append([(min(max_num_batched_tokens, max_model_len - cached), cached, True)])
    n = 1
    while n < num_decode:  # eager decode (no graphs, or a batch past the largest), at each KDA split
        rows.append(decode[:n])
        n *= 2
    rows.append(decode)
    steps: list[WarmupStep] = []
    for step_rows in rows:
        step = WarmupStep(*(tuple(column) for column in zip(*step_rows))) if step_rows else None
        if (step is None or step in steps or len(step_rows) > max_num_seqs or min(step.query_lens) < 1
                or step.num_tokens > max_num_batched_tokens
                or any(q + c > max_model_len for q, c, _ in step_rows)):
            continue
        steps.append(step)
    return steps
