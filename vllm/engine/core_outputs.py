"""The engine core's side of the outputs when the front end builds them (the served engine's layout, as upstream's
EngineCoreOutput): per child request, the token ids new since its last record, their logprob rows as the sampler
gave them, and how it finished; no text, no logprob dicts, no RequestOutput. The front end
(`frontend_outputs.py`) detokenizes, applies stop strings (then tells the core to finish the child) and builds
the responses in its own process, off the core's step loop.

A record is a plain tuple, pickled with the step's message (cheaper than objects: serial_utils.py's measurements):
(child_id, new_token_ids, logprob_row | None, prompt_logprob_rows | None, finish | None, stop_reason,
 num_cached_tokens, first_scheduled_time, num_preemptions, spec_counts | None, error | None)
where logprob_row is (ids, logprobs, rank) of the one new token (requests with logprobs never speculate),
finish a RequestStatus value ("stop", "length", "abort", "error") and spec_counts the child's speculative
decoding counters (num_drafts, num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos).
"""
from __future__ import annotations

from dataclasses import dataclass

from vllm.core.request import Request, RequestStatus
from vllm.sampling_params import SamplingParams

CoreRecord = tuple


@dataclass(slots=True)
class _Child:
    request: Request
    parent_id: str
    num_sent: int = 0
    done: bool = False
    prompt_rows: list | None = None  # prompt logprob rows not sent yet


class CoreOutputCollector:
    """The engine's output side in the core process, in OutputProcessor's place (same methods, records out)."""

    def __init__(self) -> None:
        self.parents: dict[str, list[str]] = {}  # request id -> its child ids, while any is unfinished
        self.children: dict[str, _Child] = {}
        self.num_generation_tokens = 0  # tokens each finished child kept (as OutputProcessor counts them)
        self.num_prompt_tokens_cached = 0

    def add(self, request_id: str, prompt: str | None, children: list[Request], params: SamplingParams) -> None:
        self.parents[request_id] = [c.request_id for c in children]
        for c in children:
            self.children[c.request_id] = _Child(c, request_id)

    def child_ids(self, request_id: str) -> list[str]:
        return list(self.parents.get(request_id, ()))

    def add_prompt_logprobs(self, child_id: str, rows: list) -> None:
        child = self.children.get(child_id)
        if child is not None:
            child.prompt_rows = (child.prompt_rows or []) + list(rows)

    def process(self, updated: list[Request], logprobs: dict, now: float | None = None
                ) -> tuple[list[CoreRecord], list[str], list[str]]:
        """A record per child that got tokens this step; nothing is stopped or failed here (the front end
        decides stop strings and reports them back)."""
        records = []
        for req in updated:
            child = self.children.get(req.request_id)
            if child is not None and not child.done:
                finish = req.status.value if req.status.finished else None
                records.append(self._record(child, logprobs.get(req.request_id), finish))
        return records, [], []

    def fail(self, child_id: str, message: str) -> CoreRecord | None:
        child = self.children.get(child_id)
        return None if child is None or child.done else self._record(child, None, RequestStatus.FINISHED_ERROR.value,
                                                                      message)

    def abort(self, request_id: str) -> list[CoreRecord]:
        return [self._record(self.children[cid], None, RequestStatus.FINISHED_ABORTED.value)
                for cid in self.child_ids(request_id) if not self.children[cid].done]

    def finished_by_front_end(self, child_id: str, kept_tokens: int) -> bool:
        """The front end finished the child (a stop string, or its output failed): no record, `kept_tokens` of
        its tokens count as generated. False if the core had finished it already."""
        child = self.children.get(child_id)
        if child is None or child.done:
            return False
        self._done(child, kept_tokens)
        return True

    def _record(self, child: _Child, row, finish: str | None, error: str | None = None) -> CoreRecord:
        req = child.request
        new = req.output_token_ids[child.num_sent:]
        if child.num_sent == 0 and new:
            self.num_prompt_tokens_cached += req.num_cached_tokens
        child.num_sent = len(req.output_token_ids)
        st = req.spec_stats
        spec = None if st is None else (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens,
                                         list(st.num_accepted_tokens_per_pos))
        prompt_rows, child.prompt_rows = child.prompt_rows, None
        if finish is not None:
            self._done(child, child.num_sent)
        return (req.request_id, new, row, prompt_rows, finish, req.stop_reason if finish else None,
                req.num_cached_tokens, req.first_scheduled_time, req.num_preemptions, spec, error)

    def _done(self, child: _Child, kept_tokens: int) -> None:
        child.done = True
        self.num_generation_tokens += kept_tokens
        siblings = self.parents.get(child.parent_id, ())
        if all(self.children[cid].done for cid in siblings):
            for cid in siblings:
                del self.children[cid]
            self.parents.pop(child.parent_id, None)
