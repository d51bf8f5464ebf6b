"""StructuredOutputManager: structured outputs in the engine core. Each constrained request's grammar (xgrammar,
upstream's default backend) is compiled off the step loop, its matcher advanced by the request's accepted
tokens, and each step's constrained rows get their token bitmask.

The bitmask of a step needs the tokens of the step before it, which under async scheduling are still on the
device when the step is prepared. So the engine launches the step's forward first and asks for the bitmask
only before its sampling (ModelRunner.execute_model's `before_sampling`): the host waits for the previous
step's tokens, advances the matchers and fills the bitmask while the device runs the forward. Steps without a
constrained row are not touched.

Constrained requests decode one token per step: their drafts would need the grammar's mask at each draft
position (a matcher forked per position); without drafts their outputs are exact, and other requests keep
speculating. docs/structured_outputs.md has the whole contract.
"""
from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from vllm.core.request import Request
from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size
from vllm.sample.grammar_bitmask import GrammarBitmask
from vllm.structured_output.params import StructuredOutputsParams


MAX_CACHED_GRAMMARS = 256
# One thread fills a step's masks (xgrammar's BatchGrammarMatcher, in C++ without the GIL): on the H100 machine
# (16 cores) eight threads took 3.3 ms a step for 64 JSON rows, one thread 0.4-0.5 ms (docs/structured_outputs.md).
FILL_THREADS = 1


class StructuredOutputRequest:
    """One request's grammar: the compile in flight, then its matcher and how many output tokens it accepted."""

    __slots__ = ("future", "_matcher", "num_accepted")

    def __init__(self, future: Future) -> None:
        self.future, self._matcher, self.num_accepted = future, None, 0

    @property
    def ready(self) -> bool:
        """The compile finished (or failed): the scheduler admits the request only then."""
        return self.future.done()

    @property
    def matcher(self):
        """The grammar's matcher (the scheduler admitted the request once its compile was done); raises ValueError
        when the grammar failed to compile."""
        if self._matcher is None:
            import xgrammar as xgr
            try:
                compiled = self.future.result()
            except Exception as e:  # noqa: BLE001 - whatever the compiler raised, the request names it
                raise ValueError(f"the structured output's grammar failed to compile: {e}") from None
            self._matcher = xgr.GrammarMatcher(compiled)
        return self._matcher

    def advance(self, output_token_ids: list[int]) -> str | None:
        """Feeds the output tokens the matcher has not seen; returns why one was refused (None: all taken)."""
        matcher = self.matcher
        while self.num_accepted < len(output_token_ids):
            token = output_token_ids[self.num_accepted]
            if not matcher.accept_token(token):
                return (f"token {token} at output position {self.num_accepted} breaks the structured output's "
                        "grammar" + (" (it was already complete)" if matcher.is_terminated() else ""))
            self.num_accepted += 1
        return None


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int], max_num_seqs: int,
                 device: torch.device) -> None:
        self.tokenizer, self.vocab_size, self.device = tokenizer, vocab_size, device
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_num_seqs = max_num_seqs
        self._compiler = None  # built with the first constrained request (TokenizerInfo walks the vocabulary)
        self._executor: ThreadPoolExecutor | None = None
        # A grammar's compile, shared by every request with the same constraint (an agent's tool schema, a
        # benchmark's batch): later requests start with it done, or wait on the one compile in flight.
        self._compiles: OrderedDict[tuple, Future] = OrderedDict()
        self._live: list[Request] = []  # the constrained requests not yet seen finished
        # Two staging buffers (rows, bitmask, event of the copy that last read them), used in turn: a step's
        # mask is filled while the copy of the step before's may still be queued.
        self._staging: list[list] = []
        self._turn = 0
        self._batch = None  # xgrammar's BatchGrammarMatcher: several rows' masks filled in parallel

    def add(self, request: Request, params: StructuredOutputsParams) -> None:
        """Starts compiling the request's grammar in the background. Under tensor parallelism it compiles here:
        when a compile finishes decides the step its request is admitted in, which must be the same on every
        rank (vllm/executor)."""
        self._live.append(request)
        if get_tensor_model_parallel_world_size() > 1:
            future = Future()
            try:
                future.set_result(self._compile(params))
            except Exception as e:  # noqa: BLE001 - failed as the background compile fails: at its first step
                future.set_exception(e)
            request.structured_output = StructuredOutputRequest(future)
            return
        key = params.key()
        future = self._compiles.get(key)
        if future is None or (future.done() and future.exception() is not None):  # a failure is not kept
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
            future = self._compiles[key] = self._executor.submit(self._compile, params)
            if len(self._compiles) > MAX_CACHED_GRAMMARS:
                self._compiles.popitem(last=False)
        self._compiles.move_to_end(key)
        request.structured_output = StructuredOutputRequest(future)

    def wait_for_compiles(self, timeout: float) -> None:
        """Blocks until a pending compile finishes (or `timeout` s): for an engine with nothing else to run,
        which would otherwise spin on step() and hold the GIL the compiling thread needs."""
        pending = [r.structured_output.future for r in self._live
                   if not r.status.finished and not r.structured_output.ready]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def _compile(self, params: StructuredOutputsParams):
        import xgrammar as xgr
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        kind, source = params.grammar_spec()
        if kind == "json":
            return self._compiler.compile_json_schema(source, any_whitespace=not params.disable_any_whitespace)
        if kind == "json_object":  # OpenAI's JSON mode promises an object, not any JSON value
            return self._compiler.compile_json_schema('{"type": "object"}',
                                                      any_whitespace=not params.disable_any_whitespace)
        if kind == "regex":
            return self._compiler.compile_regex(source)
        return self._compiler.compile_grammar(source)

    def any_live(self) -> bool:
        """Whether an unfinished request has a grammar: steps without one skip every per-row check (the cost
        is the live constrained requests, not the batch)."""
        if self._live and any(r.status.finished for r in self._live):
            self._live = [r for r in self._live if not r.status.finished]
        return bool(self._live)

    def advance(self, updated: list[Request]) -> list[tuple[Request, str]]:
        """Feeds a step's new tokens to the matchers of the `updated` requests; the unfinished ones whose token
        the grammar refused, with the reason."""
        if not self.any_live():
            return []
        return [(r, reason) for r in updated if r.structured_output is not None and not r.status.finished
                and (reason := r.structured_output.advance(r.output_token_ids)) is not None]

    def _next_staging(self, words: int) -> list:
        if not self._staging:
            pin = self.device.type == "cuda"
            self._staging = [[torch.empty(self.max_num_seqs, dtype=torch.int64, pin_memory=pin),
                              torch.empty((self.max_num_seqs, words), dtype=torch.int32, pin_memory=pin), None]
                             for _ in range(2)]
        buf = self._staging[self._turn]
        self._turn ^= 1
        if buf[2] is not None:
            buf[2].synchronize()  # the copy that read it two steps ago (done by now: that step has been drained)
        return buf

    def grammar_bitmask(self, rows: list[Request]) -> tuple[GrammarBitmask | None, list[tuple[Request, str]]]:
        """The bitmask of a step's sampling `rows` (in the sampler's order) that have a grammar, and the requests
        whose grammar cannot go on (with the reason): their rows are left unconstrained and the engine fails
        them. A finished request's row is left unconstrained too (its token is dropped)."""
        import xgrammar as xgr
        constrained = [(j, r) for j, r in enumerate(rows) if r.structured_output is not None]
        if not constrained:
            return None, []
        n = len(constrained)
        staging = self._next_staging(xgr.get_bitmask_shape(1, self.vocab_size)[1])
        host_rows, host = staging[0][:n], staging[1][:n]
        host_rows.numpy()[:] = [j for j, _ in constrained]  # into the pinned buffer, no tensor built
        host.fill_(-1)
        failed, fill = [], []
        for i, (_, req) in enumerate(constrained):
            if req.status.finished:
                continue
            try:
                matcher = req.structured_output.matcher
            except ValueError as e:
                failed.append((req, str(e)))
                continue
            if not matcher.is_terminated():
                fill.append((i, matcher))
        if fill:  # one call for every row (a JSON row: 3-8 us on one thread, more with a larger vocabulary)
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
            self._batch.batch_fill_next_token_bitmask([m for _, m in fill], host, [i for i, _ in fill])
        every_row = n == len(rows)  # then rows are 0..n-1 in order
        if self.device.type != "cuda":
            return GrammarBitmask(host_rows.clone(), host.clone(), every_row), failed
        mask = GrammarBitmask(host_rows.to(self.device, non_blocking=True), host.to(self.device, non_blocking=True),
                              every_row)
        staging[2] = torch.cuda.Event()
        staging[2].record()
        return mask, failed
