"""Per-request token counts for the sampling penalties, kept on the device across steps.

Repetition penalties look at every prompt and output token of a request, presence and frequency penalties at
every output token. Rebuilding those counts from the token lists each step cost time in the context length
(65 ms a step at 256 requests x 4K tokens on a CPU). Here a request that uses a penalty gets a row once: its
prompt's tokens are marked when it first samples and each step adds only the tokens it generated since, so a
step's host work is the new tokens. Rows are reused after their request finishes. Row 0 stays zero: the
row an unpenalised request of a batch reads.
"""
from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Protocol

import torch

from vllm.utils import async_tensor_h2d

ZERO_ROW = 0  # never claimed: all counts and marks stay zero


class TokenHistory(Protocol):
    request_id: str
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


class PenaltyCounts:
    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.rows: dict[str, int] = {}
        self.counted: dict[str, int] = {}  # output tokens already in the row
        self.free: list[int] = []
        self.output_counts = torch.zeros(1, vocab_size, dtype=torch.float32, device=self.device)
        self.prompt_seen = torch.zeros(1, vocab_size, dtype=torch.bool, device=self.device)

    def gather(self, requests: Sequence[TokenHistory | None],
               in_flight: tuple[torch.Tensor, dict[str, int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The requests' rows, brought up to date: output-token counts [B, V] float32 and prompt-token marks
        [B, V] bool, in the requests' order (None: a zero row). `in_flight`: the device tokens of a step still
        running and each request's row in them; a request's token there is counted now, from the device."""
        rows, new_rows, new_cols, flight_rows, flight_index = [], [], [], [], []
        for req in requests:
            if req is None:
                rows.append(ZERO_ROW)
                continue
            rid = req.request_id
            row = self.rows.get(rid)
            if row is None:
                row = self._claim(req)
            out = req.output_token_ids
            start = self.counted[rid]
            if len(out) > start:
                new_rows += [row] * (len(out) - start)
                new_cols += out[start:]
                self.counted[rid] = len(out)
            j = in_flight[1].get(rid) if in_flight is not None else None
            if j is not None and self.counted[rid] == len(out):  # its token lands in output_token_ids later
                flight_rows.append(row)
                flight_index.append(j)
                self.counted[rid] += 1
            rows.append(row)
        if new_rows:
            index = async_tensor_h2d([new_rows, new_cols], torch.int64, self.device)
            self._add(index[0], index[1])
        if flight_rows:
            index = async_tensor_h2d([flight_rows, flight_index], torch.int64, self.device)
            self._add(index[0], in_flight[0][index[1]])
        rows_t = async_tensor_h2d(rows, torch.int64, self.device)
        return self.output_counts[rows_t], self.prompt_seen[rows_t]

    def _add(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        self.output_counts.index_put_((rows, token_ids), torch.ones(rows.shape[0], device=self.device),
                                      accumulate=True)

    def prune(self, alive: Container[str]) -> None:
        """Frees the rows of requests that are no longer alive."""
        for rid in [rid for rid in self.rows if rid not in alive]:
            self.free.append(self.rows.pop(rid))
            del self.counted[rid]

    def _claim(self, req: TokenHistory) -> int:
        if not self.free:
            self._grow()
        row = self.free.pop()
        self.rows[req.request_id], self.counted[req.request_id] = row, 0
        self.output_counts[row] = 0
        self.prompt_seen[row] = False
        if req.prompt_token_ids:
            # index_fill_: an indexed assignment of a Python scalar copies it from pageable memory (a host sync)
            self.prompt_seen[row].index_fill_(0, async_tensor_h2d(req.prompt_token_ids, torch.int64, self.device),
                                              True)
        return row

    def _grow(self) -> None:
        n = self.output_counts.shape[0]
        more = max(n, 8)
        self.output_counts = torch.cat([self.output_counts, self.output_counts.new_zeros(more, self.vocab_size)])
        self.prompt_seen = torch.cat([self.prompt_seen, self.prompt_seen.new_zeros(more, self.vocab_size)])
        self.free.extend(range(n + more - 1, n - 1, -1))
