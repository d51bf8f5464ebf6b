"""The sampling state the worker keeps per request across steps: penalty counts on the device (PenaltyCounts)
and, per kind of row, the last step's metadata, which a step with the same request objects reuses."""
from __future__ import annotations

from collections.abc import Container

import torch

from vllm.core.request import Request
from vllm.sample.bad_words import banned_by_bad_words
from vllm.sample.penalties import PenaltyCounts
from vllm.sample.sampler import SamplingMetadata
from vllm.worker.in_flight_fill import InFlightTokens


class SamplingState:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.device = device
        self.penalties = PenaltyCounts(vocab_size, device)
        # Per kind of row ("sample", "verify"): the last step's requests and the metadata built for them.
        self._cache: dict[str, tuple[list[Request], SamplingMetadata]] = {}

    def metadata(self, reqs: list[Request], in_flight: InFlightTokens | None, kind: str) -> SamplingMetadata | None:
        """The rows' sampling metadata. Without bans or penalties it depends only on which requests the rows are,
        so a decode step with the same request objects as the last step of this `kind` reuses its device tensors
        (objects, not ids: an id may be reused by a later request). `in_flight`: the device tokens of the step
        still running whose outputs have not reached the requests (the penalties count them from there)."""
        if not reqs:
            return None
        cached = self._cache.get(kind)
        if cached is not None and len(cached[0]) == len(reqs) and all(a is b for a, b in zip(cached[0], reqs)):
            return cached[1]
        # The row samples its output number len(outputs) + placeholders (the step's own placeholder included).
        banned = [(sorted(r.eos_token_ids | r.sampling_params.all_stop_token_ids)
                   if len(r.output_token_ids) + r.num_output_placeholders <= r.sampling_params.min_tokens else [])
                  + banned_by_bad_words(r.sampling_params.bad_words_token_ids, r.output_token_ids)
                  for r in reqs]
        meta = SamplingMetadata.from_requests([r.sampling_params for r in reqs], [r.generator for r in reqs],
                                              banned, self.device, self._penalty_counts(reqs, in_flight))
        # Bans that depend on the output (min_tokens, bad words) change from step to step: never reused.
        if meta.no_penalties and not any(banned) and not any(r.sampling_params.bad_words_token_ids for r in reqs):
            self._cache[kind] = (reqs, meta)
        else:
            self._cache.pop(kind, None)
        return meta

    def _penalty_counts(self, reqs: list[Request],
                        in_flight: InFlightTokens | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows' device-side token counts (zero rows for unpenalised ones), None if no row has a penalty."""
        rows = [r if r.sampling_params.has_penalties else None for r in reqs]
        if not any(rows):
            return None
        return self.penalties.gather(rows, in_flight)

    def remove_finished(self, alive: Container[str]) -> None:
        """Frees the penalty rows of requests that are no longer alive."""
        if self.penalties.rows:
            self.penalties.prune(alive)
