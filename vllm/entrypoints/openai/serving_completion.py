"""POST /v1/completions: OpenAI's legacy text completions, streamed or not, with legacy-format logprobs."""
from __future__ import annotations

import time
import uuid
from contextlib import aclosing

from fastapi import Request
from starlette.responses import JSONResponse, Response

from vllm.entrypoints.openai.protocol import APIError, CompletionRequest
from vllm.entrypoints.openai.serving_engine import OpenAIServing, prompt_logprobs_json
from vllm.entrypoints.openai.sse import DONE, SSEResponse, sse, started, stream_when_started, until_disconnect
from vllm.inputs.validation import prompt_problem
from vllm.outputs import CompletionOutput, Logprob, OutputJoiner, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        self.check_logprobs("logprobs", req.logprobs)
        self.check_logprobs("prompt_logprobs", req.prompt_logprobs)
        # With echo, logprobs cover the prompt too, as OpenAI's do.
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        try:
            params = req.sampling_params(req.max_tokens, req.logprobs, prompt_logprobs, self.default_sampling)
            beam = req.beam_search_params(req.max_tokens) if req.use_beam_search else None
        except ValueError as e:
            raise self.error(e) from None
        self.check_prompts(req.prompt)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        prompts = req.prompt
        if req.truncate_prompt_tokens is not None:  # the last N tokens of each prompt
            n = req.truncate_prompt_tokens
            prompts = [{"prompt_token_ids": (p if isinstance(p, list) else self.engine.tokenizer.encode(p))[-n:]}
                       for p in prompts]
        for i, p in enumerate(prompts):
            self.log_request(f"{request_id}-{i}", p, params)
        run = _Run(self, req, request_id)
        outputs = self.beam_search(prompts, beam, request_id, params.logprobs, params.prompt_logprobs) \
            if beam is not None else self.generate(prompts, params, request_id)
        if req.stream and beam is not None:  # the beams come at the search's end: a disconnect before then aborts it
            return await stream_when_started(raw, outputs, run.stream, self.stall_limit)
        if req.stream:  # bad input raises before the response starts
            return SSEResponse(run.stream(await started(outputs)), self.stall_limit)
        return await until_disconnect(raw, run.full(outputs))

    def check_prompts(self, prompts: list[str] | list[list[int]]) -> None:
        """The engine's prompt checks (vllm.inputs.validation), answered before any prompt of the call starts,
        naming the prompt at fault."""
        vocab = self.engine.config.model_config.hf_config.vocab_size
        for i, p in enumerate(prompts):
            problem = prompt_problem(p, vocab) if isinstance(p, list) else prompt_problem(None, vocab, p)
            if problem is not None:
                raise APIError(400, f"{'prompt' if len(prompts) == 1 else f'prompt[{i}]'}: {problem}", "prompt")


class _Run:
    """One completion call: turns engine outputs (deltas) into OpenAI choices, streamed or joined."""

    def __init__(self, serving: OpenAIServingCompletion, req: CompletionRequest, request_id: str) -> None:
        self.serving, self.req, self.tokenizer = serving, req, serving.engine.tokenizer
        self.base = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                     "model": serving.model_name}
        self.prompt_tokens: dict[int, int] = {}  # per prompt
        self.cached_tokens: dict[int, int] = {}  # per prompt: found in the prefix cache
        self.completion_tokens: dict[int, int] = {}  # per choice, summed over deltas

    def index(self, prompt_index: int, c: CompletionOutput) -> int:
        return prompt_index * self.req.n + c.index

    def usage(self) -> dict:
        return self.serving.settings.usage(sum(self.prompt_tokens.values()), sum(self.completion_tokens.values()),
                                           sum(self.cached_tokens.values()))

    def extras(self, out: RequestOutput, c: CompletionOutput | None, first: bool) -> dict:
        """The vLLM extension fields of a choice: token ids (return_token_ids), prompt_logprobs; the prompt's
        only with its first chunk."""
        extra = {}
        if self.req.return_token_ids:
            if first:
                extra["prompt_token_ids"] = out.prompt_token_ids
            extra["token_ids"] = c.token_ids
        if self.req.prompt_logprobs is not None and first:
            extra["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
        return extra

    def count(self, i: int, out: RequestOutput) -> None:
        self.prompt_tokens[i] = len(out.prompt_token_ids)
        self.cached_tokens[i] = out.num_cached_tokens
        for c in out.outputs:
            k = self.index(i, c)
            self.completion_tokens[k] = self.completion_tokens.get(k, 0) + len(c.token_ids)

    def prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)

    async def full(self, outputs) -> Response:
        joined: dict[int, OutputJoiner] = {}
        async with aclosing(outputs):
            async for i, out in outputs:
                self.count(i, out)
                joined.setdefault(i, OutputJoiner()).add(out)
        choices = []
        for i, out in sorted((i, j.pop()) for i, j in joined.items()):
            for c in out.outputs:
                text, ids, lps = c.text, c.token_ids, c.logprobs
                if self.req.echo:
                    text = self.prompt_text(out) + text
                    ids = out.prompt_token_ids + ids
                    lps = (out.prompt_logprobs or []) + (lps or []) if lps is not None else None
                # prompt_logprobs is always a key (null unless asked for), as in upstream's choices.
                choices.append({"index": self.index(i, c), "text": text,
                                "logprobs": self.logprobs(ids, lps, 0) if lps is not None else None,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                                "prompt_logprobs": None, **self.extras(out, c, True)})
        choices.sort(key=lambda ch: ch["index"])
        # system_fingerprint: OpenAI's field, null as upstream's, so the body has every key clients' models have.
        return JSONResponse({**self.base, "choices": choices, "usage": self.usage(), "system_fingerprint": None})

    async def stream(self, outputs):
        started: set[int] = set()  # choices that have had a chunk (the echo goes with the first)
        offsets: dict[int, int] = {}
        prompt_lps: dict[int, list] = {}  # per prompt: its logprobs come once, in its first delta
        final_usage, continuous = self.serving.include_usage(self.req)
        try:
            async with aclosing(outputs):
                async for i, out in outputs:  # deltas: each piece of text, ids and logprobs comes once
                    self.count(i, out)
                    if out.prompt_logprobs is not None:
                        prompt_lps[i] = out.prompt_logprobs
                    for c in out.outputs:
                        k = self.index(i, c)
                        text, ids, lps = c.text, c.token_ids, c.logprobs
                        if k not in started and self.req.echo:
                            text = self.prompt_text(out) + text
                            ids = out.prompt_token_ids + ids
                            lps = prompt_lps.get(i, []) + lps if lps is not None else None
                        first = k not in started
                        if not (text or c.finish_reason or (ids and lps is not None) or (
                                first and (self.req.return_token_ids or self.req.prompt_logprobs is not None))):
                            continue  # the detokenizer held text back (a possible stop string): nothing to say
                        started.add(k)
                        logprobs = self.logprobs(ids, lps, offsets.get(k, 0)) if lps is not None else None
                        if logprobs is not None:
                            offsets[k] = offsets.get(k, 0) + sum(len(t) for t in logprobs["tokens"])
                        chunk = {**self.base, "choices": [{"index": k, "text": text, "logprobs": logprobs,
                                                           "finish_reason": c.finish_reason,
                                                           "stop_reason": c.stop_reason,
                                                           **self.extras(out, c, first)}]}
                        if continuous:
                            chunk["usage"] = self.usage()
                        yield sse(chunk)
            if final_usage:
                yield sse({**self.base, "choices": [], "usage": self.usage()})
        except APIError as e:  # headers are gone: the error becomes the stream's last event
            yield sse(e.body())
        yield DONE

    def logprobs(self, ids: list[int], lps: list[dict[int, Logprob] | None], offset: int) -> dict:
        """OpenAI's legacy format; a None row (the first prompt token has no logprob) stays None.

        text_offset indexes the choice's text, which omits skipped special tokens (an echoed <bos>): those take
        no room in it."""
        skipped = self.serving.special_ids if self.req.skip_special_tokens else frozenset()
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, row in zip(ids, lps):
            tok = row[tid].decoded_token if row else self.tokenizer.decode([tid])
            tokens.append(self.serving.token_label(self.req, tid, tok))
            token_lps.append(row[tid].logprob if row else None)
            tops.append({self.serving.token_label(self.req, t, lp.decoded_token): lp.logprob
                         for t, lp in row.items()} if row else None)
            offsets.append(offset)
            offset += 0 if tid in skipped else len(tok)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

