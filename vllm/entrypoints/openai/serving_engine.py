"""What the completion and chat endpoints share: model-name checks, request logging, running several prompts
as engine requests with metrics, error mapping (the SSE / disconnect plumbing is sse.py)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from vllm.beam_search import beam_search_steps, beam_step_params
from vllm.engine.input_processor import checked_max_tokens
from vllm.entrypoints.openai.chat_tools import ToolSettings
from vllm.entrypoints.openai.metrics import Metrics
from vllm.entrypoints.openai.protocol import APIError
from vllm.entrypoints.openai.sse import STALLED_AT_SHUTDOWN_S, STALLED_CLIENT_S
from vllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, SampleLogprobs
from vllm.sampling_params import MAX_LOGPROBS, BeamSearchParams, RequestOutputKind, SamplingParams

logger = logging.getLogger("vllm.entrypoints.openai")

_PARAM_NAMES = frozenset(SamplingParams.__dataclass_fields__) | {"prompt_token_ids", "length_penalty"}


@dataclass(slots=True)
class ServerSettings:
    served_model_names: list[str]
    max_log_len: int | None = None
    log_requests: bool = False  # --enable-log-requests
    max_body_bytes: int = 1 << 20
    api_key: str | None = None
    chat_template: str | None = None  # --chat-template (its text); None: the tokenizer's own
    trust_request_chat_template: bool = False  # --trust-request-chat-template: requests may bring a template
    chat_template_timeout_s: float = 10.0  # --chat-template-timeout: a render running longer is stopped (400)
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details
    enable_force_include_usage: bool = False  # every stream ends with usage, asked for or not
    enable_server_load_tracking: bool = False  # GET /load: requests in flight
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info
    shutdown_timeout_s: float = 0.0  # how long a signal lets requests in flight finish
    root_path: str = ""
    access_log: bool = True
    docs: bool = True  # FastAPI's /docs, /redoc, /openapi.json
    tools: ToolSettings = ToolSettings()  # --enable-auto-tool-choice, --tool-call-parser, --reasoning-parser
    show_hidden_metrics: bool = False  # --show-hidden-metrics-for-version: the deprecated metric names too
    max_logprobs: int = MAX_LOGPROBS  # --max-logprobs: -1 (the whole vocabulary) needs it to cover the vocabulary
    response_store_dir: str | None = None  # stored /v1/responses shared by several API server processes

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
        """`cached_tokens`: prompt tokens found in the prefix cache (RequestOutput.num_cached_tokens), summed over
        the prompts (once per prompt, whatever n)."""
        out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
               "total_tokens": prompt_tokens + completion_tokens}
        if self.enable_prompt_tokens_details:
            out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        return out


def prompt_logprobs_json(rows: PromptLogprobs | None) -> list | None:
    """Upstream's prompt_logprobs: per prompt token None (the first has none) or {id: {logprob, rank,
    decoded_token}}."""
    if rows is None:
        return None
    return [None if row is None else {str(tid): {"logprob": lp.logprob, "rank": lp.rank,
                                                 "decoded_token": lp.decoded_token} for tid, lp in row.items()}
            for row in rows]


class OpenAIServing:
    def __init__(self, engine, settings: ServerSettings, metrics: Metrics) -> None:
        self.engine, self.settings, self.metrics = engine, settings, metrics
        self.shutting_down = False
        # generation_config.json's sampling fields: the defaults of requests that leave them unset.
        self.default_sampling = engine.config.model_config.get_diff_sampling_param()
        # transformers rebuilds all_special_ids from the special-token map on every read: once per streamed chunk
        # with logprobs was a visible share of the front end's CPU (py-spy, docs/serving.md)
        self.special_ids = frozenset(engine.tokenizer.all_special_ids)

    def stall_limit(self) -> float:
        return STALLED_AT_SHUTDOWN_S if self.shutting_down else STALLED_CLIENT_S

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    def include_usage(self, req) -> tuple[bool, bool]:
        """(usage at the end of the stream, usage in every chunk) for a streaming request."""
        opts = req.stream_options
        final = bool(opts and opts.include_usage) or self.settings.enable_force_include_usage
        # As upstream: continuous_usage_stats only adds to usage that is included at all.
        return final, final and bool(opts and opts.continuous_usage_stats)

    def token_label(self, req, tid: int, text: str) -> str:
        """A logprob entry's token: its text, or "token_id:N" (--return-tokens-as-token-ids, or the field)."""
        as_ids = req.return_tokens_as_token_ids
        return f"token_id:{tid}" if (self.settings.return_tokens_as_token_ids if as_ids is None else as_ids) \
            else text

    def check_logprobs(self, field: str, k: int | None) -> None:
        """Upstream's --max-logprobs check: -1 asks for the whole vocabulary, which is that many logprobs."""
        limit = self.settings.max_logprobs
        if k is None or limit == -1:
            return
        vocab = self.engine.config.model_config.hf_config.vocab_size
        wanted = vocab if k == -1 else k
        if wanted > limit:
            what = f"-1 (the whole vocabulary, {vocab} tokens)" if k == -1 else str(k)
            raise APIError(400, f"{field}={what} is over the server's limit of {limit} logprobs per token: ask for "
                                f"at most {limit}, or start the server with a larger --max-logprobs", field)

    def check_model(self, name: str | None) -> None:
        """An absent or empty `model` means the served model, as upstream; another name is a 404."""
        if name and name not in self.settings.served_model_names:
            raise APIError(404, f"The model `{name}` does not exist: this server serves "
                                f"{', '.join(self.settings.served_model_names)}", "model")

    def log_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        if self.settings.log_requests:
            n = self.settings.max_log_len
            logger.info("Received request %s: prompt: %r, params: %s", request_id,
                        prompt if n is None else prompt[:n], params)

    def error(self, e: Exception) -> APIError:
        """Engine exceptions as HTTP errors: bad input is the client's (400), the rest is ours."""
        if isinstance(e, APIError):
            return e
        if isinstance(e, ValueError):  # SamplingParams' and the engine's messages start with the field's name
            word = str(e).split(" ", 1)[0]
            return APIError(400, str(e), word if word in _PARAM_NAMES else None)
        if self.shutting_down:
            return APIError(503, "the server is shutting down; the request was not completed")
        logger.error("request failed: %s", e)
        return APIError(500, f"the engine failed: {e}")

    def beam_search(self, prompts: list[str | list[int] | dict], params: BeamSearchParams, request_id: str,
                    logprobs: int | None = None,
                    prompt_logprobs: int | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, final output) for each prompt, its choices the beams, best first, with `logprobs` per
        token (the chosen token and the top k; None: none). Each step runs every live beam as an engine request
        through `generate` (vllm/beam_search.py drives the search). The checks a plain request gets (prompt and
        max_tokens within --max-model-len) raise here, as an APIError before any response; the search runs when
        the result is iterated, and closing it aborts the step running."""
        tok = self.engine.tokenizer
        ids = [p if isinstance(p, list) else p["prompt_token_ids"] if isinstance(p, dict) else tok.encode(p)
               for p in prompts]
        try:
            for p in ids:
                checked_max_tokens(len(p), params.max_tokens, self.engine.config.model_config.max_model_len)
            step_params = dataclasses.replace(beam_step_params(params, logprobs),
                                              output_kind=RequestOutputKind.FINAL_ONLY)
            first_params = step_params if prompt_logprobs is None else dataclasses.replace(
                step_params, prompt_logprobs=prompt_logprobs)
        except ValueError as e:
            raise self.error(e) from None
        return self._beam_search(ids, params, (first_params, step_params), request_id, logprobs)

    async def _beam_search(self, ids: list[list[int]], params: BeamSearchParams,
                           step_params: tuple[SamplingParams, SamplingParams], request_id: str,
                           logprobs: int | None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The search of `beam_search`; the first step (each prompt alone) also brings the prompts' logprobs
        if asked for (step_params[0])."""
        tok = self.engine.tokenizer
        steps = beam_search_steps(None, ids, params, self.engine.config.model_config.eos_token_ids(tok.eos_token_id))
        prompt_lps: list[PromptLogprobs | None] = [None] * len(ids)
        cached = [0] * len(ids)
        try:
            batch, step = next(steps), 0
            while True:
                outs: list[RequestOutput | None] = [None] * len(batch)
                sp = step_params[0] if step == 0 else step_params[1]
                async with aclosing(self.generate(batch, sp, f"{request_id}-beam{step}")) as gen:
                    async for j, out in gen:
                        outs[j] = out
                if step == 0:  # one beam per prompt, in order
                    prompt_lps = [out.prompt_logprobs for out in outs]
                    cached = [out.num_cached_tokens for out in outs]
                batch, step = steps.send(outs), step + 1
        except StopIteration as finished:
            results = finished.value
        for i, result in enumerate(results):
            n = len(ids[i])
            beams = [CompletionOutput(j, tok.decode(b.tokens[n:], skip_special_tokens=True), b.tokens[n:],
                                      b.cum_logprob, beam_logprobs(b.tokens[n:], b.logprobs, logprobs),
                                      b.finish_reason, b.stop_reason)
                     for j, b in enumerate(result.sequences)]
            yield i, RequestOutput(f"{request_id}-{i}", None, ids[i], prompt_lps[i], beams, True,
                                   num_cached_tokens=cached[i])

    async def generate(self, prompts: list[str | list[int] | dict], params: SamplingParams,
                       request_id: str) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) for each prompt, each run as its own engine request; outputs are of
        params.output_kind (DELTA for streams, FINAL_ONLY for whole answers).

        Nothing is yielded until every prompt has produced its first output, so a bad prompt among several
        raises (as an APIError) before a response has started. Closing this generator aborts what is running.
        """
        if len(prompts) == 1:  # the usual call: read the engine's outputs directly, no task and queue in between
            async for out in self._generate_one(prompts[0], params, f"{request_id}-0"):
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in gen:
                    queue.put_nowait((i, out))
            except Exception as e:  # noqa: BLE001 - handed to the consumer, which maps it
                queue.put_nowait((i, e))

        tasks = [asyncio.create_task(pump(i, self.engine.generate(p, params, f"{request_id}-{i}")))
                 for i, p in enumerate(prompts)]
        counts = [_RequestCount(self.metrics.timer(), params) for _ in prompts]
        held: list | None = []
        seen: set[int] = set()
        finished = 0
        try:
            while finished < len(prompts):
                i, item = await queue.get()
                if isinstance(item, Exception):
                    raise self.error(item)
                counts[i].add(item)
                finished += item.finished
                if held is None:
                    yield i, item
                    continue
                held.append((i, item))
                seen.add(i)
                if len(seen) == len(prompts):
                    batch, held = held, None
                    for x in batch:
                        yield x
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _generate_one(self, prompt: str | list[int] | dict, params: SamplingParams,
                            request_id: str) -> AsyncIterator[RequestOutput]:
        """One prompt's outputs, as `generate` gives them, without its task and queue: those cost the event loop
        3-6 us per streamed output (benchmarks/bench_serving_generate.py, a 2-core CPU: 6.4 -> 3.2 us)."""
        gen = self.engine.generate(prompt, params, request_id)
        count = _RequestCount(self.metrics.timer(), params)
        try:
            while True:
                try:
                    item = await anext(gen)
                except StopAsyncIteration:
                    return
                except Exception as e:  # noqa: BLE001 - the engine's, mapped as the queued path maps it
                    raise self.error(e) from e
                count.add(item)
                yield item
        finally:
            await gen.aclose()  # a consumer that went away: the engine request is aborted


class _RequestCount:
    """One engine request's tokens per sample and latency metrics, as its outputs pass through `generate`."""

    def __init__(self, timer, params: SamplingParams) -> None:
        self.timer, self.params = timer, params
        self.tokens = dict.fromkeys(range(params.n), 0)

    def add(self, item: RequestOutput) -> None:
        for c in item.outputs:
            self.tokens[c.index] += len(c.token_ids)
        self.timer.update(max(self.tokens.values()))
        if item.finished:
            self.timer.finish(item, self.params, list(self.tokens.values()))
            if any(c.finish_reason == "abort" for c in item.outputs):
                # Only shutdown aborts a request whose client is still listening.
                raise APIError(503, "the server is shutting down; the request was aborted")


def beam_logprobs(tokens: list[int], rows: list[dict[int, Logprob]], k: int | None) -> SampleLogprobs | None:
    """A beam's logprobs as a plain request's: per token the chosen one and the top k (-1: all the row has)."""
    if k is None:
        return None
    return [{tid: row[tid], **{t: lp for t, lp in row.items() if k == -1 or lp.rank <= k}}
            for tid, row in zip(tokens, rows)]


