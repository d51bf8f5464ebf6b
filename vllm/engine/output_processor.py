"""OutputProcessor: per-request detokenization, stop strings, logprobs and n > 1 aggregation into RequestOutputs.

Each request gets outputs of its SamplingParams.output_kind: CUMULATIVE (everything so far), DELTA (only what is
new: what the server streams, so memory per output stays small however long the text grows) or FINAL_ONLY (one
output at the end: what LLM.generate needs). A request whose own processing raises fails alone ("error").
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from vllm.core.request import Request, RequestStatus
from vllm.engine.detokenizer import IncrementalDetokenizer
from vllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, SampleLogprobs
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.transformers_utils.tokenizer import byte_level_pieces, decoder_for

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ChildState:
    """One completion (one of the n samples) of a user request."""
    request: Request
    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: SampleLogprobs | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_seen: int = 0  # output tokens already handed to the detokenizer (a verify step appends several)
    num_sent: int = 0  # output tokens already in a DELTA output (whose logprob rows are then dropped here)


@dataclass(slots=True)
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[ChildState]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None
    finished_children: set[int] = field(default_factory=set)
    sent_prompt_logprobs: bool = False  # DELTA: prompt logprobs go out once, with the first output
    error: str | None = None


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decode_ids = decoder_for(tokenizer)
        byte_level_pieces(tokenizer, True)  # the detokenizers' table for the default skip_special_tokens, built now
        # A token's text in a logprob entry depends on its id alone: decoded once, at most one entry per vocab id
        # (a decode call of the built-in tokenizer costs ~1 us, a dict lookup 0.06; a step of 64 requests with
        # top-5 logprobs asks for 384 texts).
        self._token_texts: dict[int, str] = {}
        self.parents: dict[str, ParentState] = {}
        self.child_parent: dict[str, tuple[str, int]] = {}
        self.num_generation_tokens = 0  # tokens of every finished request (aborted ones too), for metrics
        # Prompt tokens found in the prefix cache, per engine request once its first token is out (upstream's
        # vllm:prompt_tokens_cached; a preempted request's second lookup is not counted again).
        self.num_prompt_tokens_cached = 0

    def add(self, request_id: str, prompt: str | None, children: list[Request], params: SamplingParams) -> None:
        states = [ChildState(c, i, IncrementalDetokenizer(self.tokenizer, c.prompt_token_ids, c.sampling_params),
                             [] if params.logprobs is not None else None,
                             0.0 if params.logprobs is not None else None) for i, c in enumerate(children)]
        parent = ParentState(request_id, prompt, children[0].prompt_token_ids, params, states,
                             RequestMetrics(arrival_time=children[0].arrival_time),
                             [None] if params.prompt_logprobs is not None else None)
        self.parents[request_id] = parent
        for i, c in enumerate(children):
            self.child_parent[c.request_id] = (request_id, i)

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [] if parent is None else [c.request.request_id for c in parent.children]

    def add_prompt_logprobs(self, child_id: str, rows: list[tuple[list[int], list[float], int]]) -> None:
        parent_id, index = self.child_parent[child_id]
        parent = self.parents[parent_id]
        # Preemption recomputes prompt rows already reported: keep each prompt position once (from child 0).
        if index != 0 or parent.prompt_logprobs is None:
            return
        for ids, lps, rank in rows:
            if len(parent.prompt_logprobs) < len(parent.prompt_token_ids):
                parent.prompt_logprobs.append(self._logprob_dict(ids, lps, rank))

    def process(self, updated: list[Request], logprobs: dict, now: float | None = None
                ) -> tuple[list[RequestOutput], list[str], list[str]]:
        """Turn the requests that got a token this step into outputs.

        Returns the outputs, the child request ids that a stop string finished and those whose processing raised
        (the engine must finish both kinds in the scheduler so their cache is freed).
        """
        now = time.monotonic() if now is None else now
        touched: dict[str, ParentState] = {}
        stopped_by_string, failed = [], []
        for req in updated:
            parent_id, index = self.child_parent[req.request_id]
            parent = self.parents[parent_id]
            try:
                self._advance(parent, parent.children[index], req, logprobs, now)
            except Exception as e:  # noqa: BLE001 - this request's tokens or text: it fails, the others go on
                logger.error("processing the output of request %s failed; it finishes with an error", parent_id,
                             exc_info=e)
                failed.append(req.request_id)
                self._fail_child(parent, parent.children[index], f"{type(e).__name__}: {e}")
            else:
                if parent.children[index].finish_reason == "stop" and not req.status.finished:
                    stopped_by_string.append(req.request_id)
            touched[parent_id] = parent
        outputs = [out for p in touched.values() if (out := self._output(p, now)) is not None]
        return outputs, stopped_by_string, failed

    def _advance(self, parent: ParentState, child: ChildState, req: Request, logprobs: dict, now: float) -> None:
        new_tokens = req.output_token_ids[child.num_seen:]
        if child.num_seen == 0 and new_tokens:
            self.num_prompt_tokens_cached += req.num_cached_tokens
        child.num_seen = len(req.output_token_ids)
        m = parent.metrics
        m.first_scheduled_time = m.first_scheduled_time or req.first_scheduled_time
        m.first_token_time = m.first_token_time or now
        m.last_token_time = now
        m.num_preemptions = max(m.num_preemptions, req.num_preemptions)
        if child.logprobs is not None and req.request_id in logprobs:
            ids, lps, rank = logprobs[req.request_id]
            child.logprobs.append(self._logprob_dict(ids, lps, rank))
            child.cumulative_logprob += lps[0]
        if req.spec_stats is not None:
            _add_spec_metrics(m, parent.children)
        # Stop strings wait for min_tokens, as stop tokens do: text before then may contain them.
        stop_str = child.detokenizer.update(new_tokens, check_stop=len(req.output_token_ids) >=
                                            req.sampling_params.min_tokens)
        if stop_str is not None and not req.status.finished:
            child.finish_reason, child.stop_reason = "stop", stop_str
        elif req.status.finished:
            child.finish_reason = req.status.value
            child.stop_reason = req.stop_reason
        if child.finish_reason is not None:
            parent.finished_children.add(child.index)

    def fail(self, child_id: str, message: str) -> RequestOutput | None:
        """The child request failed in a step (the engine freed it): its output, if that finishes its parent."""
        parent_id, index = self.child_parent[child_id]
        parent = self.parents[parent_id]
        self._fail_child(parent, parent.children[index], message)
        return self._output(parent, time.monotonic())

    @staticmethod
    def _fail_child(parent: ParentState, child: ChildState, message: str) -> None:
        child.finish_reason, child.stop_reason = RequestStatus.FINISHED_ERROR.value, None
        parent.finished_children.add(child.index)
        parent.error = parent.error or message

    def forget(self, request_id: str) -> None:
        """Drops a request that will get no output (the engine core refused it)."""
        parent = self.parents.pop(request_id, None)
        for c in parent.children if parent is not None else ():
            self.child_parent.pop(c.request.request_id, None)

    def abort(self, request_id: str) -> list[RequestOutput]:
        """The request's last output (none if it is unknown or finished)."""
        parent = self.parents.get(request_id)
        if parent is None:
            return []
        for c in parent.children:
            if c.finish_reason is None:
                c.finish_reason = RequestStatus.FINISHED_ABORTED.value
                parent.finished_children.add(c.index)
        out = self._output(parent, time.monotonic())
        return [] if out is None else [out]

    def _output(self, parent: ParentState, now: float) -> RequestOutput | None:
        finished = len(parent.finished_children) == len(parent.children)
        kind = parent.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        completions = []
        for c in parent.children:
            done = c.finish_reason is not None
            ids = c.request.output_token_ids
            if delta:
                text = c.detokenizer.get_next_output_text(done, delta=True)
                start, c.num_sent = c.num_sent, len(ids)
                token_ids, lps = ids[start:], c.logprobs
                if c.logprobs is not None:  # sent rows are the consumer's now: keep none of them here
                    c.logprobs = []
            else:
                text = c.detokenizer.output_text if done else c.detokenizer.get_next_output_text(False, False)
                token_ids, lps = list(ids), c.logprobs
            completions.append(CompletionOutput(
                index=c.index, text=text, token_ids=token_ids, cumulative_logprob=c.cumulative_logprob,
                logprobs=lps, finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        prompt_logprobs = parent.prompt_logprobs
        if delta:
            prompt_logprobs = None if parent.sent_prompt_logprobs else prompt_logprobs
            parent.sent_prompt_logprobs = True
        if finished:
            parent.metrics.finished_time = now
            self.num_generation_tokens += sum(len(c.request.output_token_ids) for c in parent.children)
            del self.parents[parent.request_id]
            for c in parent.children:
                self.child_parent.pop(c.request.request_id, None)
        # The prompt's cached tokens: the first child's, as upstream reports one prompt's for n > 1.
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, prompt_logprobs,
                             completions, finished, parent.metrics,
                             num_cached_tokens=parent.children[0].request.num_cached_tokens, error=parent.error)

    def _logprob_dict(self, ids: list[int], lps: list[float], rank: int) -> dict[int, Logprob]:
        out = {ids[0]: Logprob(lps[0], rank, self._token_text(ids[0]))}
        for r, (tid, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
            out.setdefault(tid, Logprob(lp, r, self._token_text(tid)))
        return out

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.decode_ids([token_id], False)
        return text


def _add_spec_metrics(m: RequestMetrics, children: list[ChildState]) -> None:
    """The user request's speculative-decoding counters: its children's, summed."""
    stats = [c.request.spec_stats for c in children]
    m.spec_num_drafts = sum(st.num_drafts for st in stats)
    m.spec_num_draft_tokens = sum(st.num_draft_tokens for st in stats)
    m.spec_num_accepted_tokens = sum(st.num_accepted_tokens for st in stats)
    m.spec_num_accepted_tokens_per_pos = [sum(col) for col in zip(*(st.num_accepted_tokens_per_pos for st in stats))]
