"""The front end's side of the outputs (upstream's front-end OutputProcessor): the engine core sends records
(`core_outputs.py`), this turns them into RequestOutputs with the same OutputProcessor the in-process engine
uses (detokenization, stop strings, logprob dicts, n > 1), and names the children a stop string (or a failure
of their own output) finished, for the core to finish and free.

Each child request is a `ChildView`: the fields of a core Request the OutputProcessor reads, kept up to date
from the records. A stop string ends a child here at once; the core may still send a token or two for it
before it hears, which are dropped.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from vllm.core.request import RequestStatus
from vllm.engine.core_outputs import CoreRecord
from vllm.engine.output_processor import OutputProcessor
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams

# (child_id, tokens it kept, RequestStatus value): children the front end finished, for the core to free
Finished = list[tuple[str, int, str]]


@dataclass(slots=True)
class SpecCounts:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


@dataclass(slots=True)
class ChildView:
    request_id: str
    parent_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    spec_stats: SpecCounts | None
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.RUNNING
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    closed: bool = False  # finished here (stop string, failed output): the core's later records are dropped


class FrontEndOutputs:
    def __init__(self, tokenizer, num_speculative_tokens: int = 0) -> None:
        self.processor = OutputProcessor(tokenizer)
        self.tokenizer = tokenizer
        self.num_spec = num_speculative_tokens
        self.views: dict[str, ChildView] = {}
        self.children: dict[str, list[str]] = {}  # request id -> child ids

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
            params: SamplingParams) -> None:
        """Before the request goes to the core; its child ids are the core's (LLMEngine.add_request)."""
        if prompt_token_ids is None:
            prompt_token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else []
        ids = [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        now = time.monotonic()
        views = [ChildView(cid, request_id, prompt_token_ids, params, now,
                           SpecCounts(num_accepted_tokens_per_pos=[0] * self.num_spec) if self.num_spec else None)
                 for cid in ids]
        self.processor.add(request_id, prompt, views, params)
        self.children[request_id] = ids
        for v in views:
            self.views[v.request_id] = v

    def discard(self, request_id: str) -> None:
        """A request the core refused: no output will come."""
        for cid in self.children.pop(request_id, ()):
            self.views.pop(cid, None)
        self.processor.forget(request_id)

    def parents_of(self, records: list[CoreRecord]) -> list[str]:
        return list(dict.fromkeys(self.views[r[0]].parent_id for r in records if r[0] in self.views))

    def apply(self, records: list[CoreRecord]) -> tuple[list[RequestOutput], Finished]:
        """The outputs the records make, and the children finished here that the core must free."""
        updated, logprobs, outputs, aborted, touched = [], {}, [], [], set()
        for cid, new, row, prompt_rows, finish, stop_reason, cached, scheduled, preemptions, spec, error in records:
            view = self.views.get(cid)
            if view is None or view.closed:
                continue
            touched.add(view.parent_id)
            if prompt_rows:
                self.processor.add_prompt_logprobs(cid, prompt_rows)
            view.output_token_ids += new
            view.num_cached_tokens, view.first_scheduled_time, view.num_preemptions = cached, scheduled, preemptions
            if spec is not None:
                view.spec_stats = SpecCounts(*spec)
            if finish == RequestStatus.FINISHED_ABORTED.value:
                aborted.append(view.parent_id)
            elif error is not None:
                view.closed = True
                if (out := self.processor.fail(cid, error)) is not None:
                    outputs.append(out)
            else:
                if finish is not None:
                    view.status, view.stop_reason = RequestStatus(finish), stop_reason
                if row is not None:
                    logprobs[cid] = row
                updated.append(view)
        if updated:
            processed, stopped, failed = self.processor.process(updated, logprobs)
            outputs += processed
        else:
            stopped, failed = [], []
        for parent_id in dict.fromkeys(aborted):
            outputs += self.processor.abort(parent_id)
        finished: Finished = []
        for cids, status in ((stopped, RequestStatus.FINISHED_STOPPED), (failed, RequestStatus.FINISHED_ERROR)):
            for cid in cids:
                view = self.views[cid]
                view.closed = True
                finished.append((cid, len(view.output_token_ids), status.value))
        for parent_id in touched:
            if parent_id not in self.processor.parents:  # its last output went out
                for cid in self.children.pop(parent_id, ()):
                    self.views.pop(cid, None)
        return outputs, finished
