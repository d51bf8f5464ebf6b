"""POST /v1/completions: OpenAI's legacy text completions, streamed or not, with legacy-format logprobs."""
from __future__ import annotations

import time
import uuid
from contextlib import aclosing

from fastapi import Request
from starlette.responses import JSONResponse, Response

from vllm.entrypoints.openai.protocol import APIError, CompletionRequest
from vllm.entrypoints.openai.serving_engine import (DONE, OpenAIServing, SSEResponse, sse, started,
                                                    until_disconnect, usage)
from vllm.outputs import CompletionOutput, Logprob, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        # With echo, logprobs cover the prompt too, as OpenAI's do.
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        try:
            params = req.sampling_params(req.max_tokens, req.logprobs, prompt_logprobs)
        except ValueError as e:
            raise self.error(e) from None
        request_id = f"cmpl-{uuid.uuid4().hex}"
        for i, p in enumerate(req.prompt):
            self.log_request(f"{request_id}-{i}", p, params)
        outputs = await started(self.generate(req.prompt, params, request_id))
        run = _Run(self, req, request_id)
        if req.stream:
            return SSEResponse(run.stream(outputs))
        return await until_disconnect(raw, run.full(outputs))


class _Run:
    """One completion call: turns cumulative engine outputs into OpenAI choices, whole or as deltas."""

    def __init__(self, serving: OpenAIServingCompletion, req: CompletionRequest, request_id: str) -> None:
        self.serving, self.req, self.tokenizer = serving, req, serving.engine.tokenizer
        self.base = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                     "model": serving.model_name}
        self.last: dict[int, RequestOutput] = {}

    def index(self, prompt_index: int, c: CompletionOutput) -> int:
        return prompt_index * self.req.n + c.index

    def usage(self) -> dict:
        return usage(sum(len(o.prompt_token_ids) for o in self.last.values()),
                     sum(len(c.token_ids) for o in self.last.values() for c in o.outputs))

    def prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)

    async def full(self, outputs) -> Response:
        async with aclosing(outputs):
            async for i, out in outputs:
                self.last[i] = out
        choices = []
        for i, out in sorted(self.last.items()):
            for c in out.outputs:
                text, ids, lps = c.text, c.token_ids, c.logprobs
                if self.req.echo:
                    text = self.prompt_text(out) + text
                    ids = out.prompt_token_ids + ids
                    lps = (out.prompt_logprobs or []) + (lps or []) if lps is not None else None
                choices.append({"index": self.index(i, c), "text": text,
                                "logprobs": self.logprobs(ids, lps, 0) if lps is not None else None,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        choices.sort(key=lambda ch: ch["index"])
        return JSONResponse({**self.base, "choices": choices, "usage": self.usage()})

    async def stream(self, outputs):
        sent_text: dict[int, int] = {}  # choice index -> characters sent
        sent_ids: dict[int, int] = {}
        offsets: dict[int, int] = {}
        try:
            async with aclosing(outputs):
                async for i, out in outputs:
                    self.last[i] = out
                    for c in out.outputs:
                        k = self.index(i, c)
                        first = k not in sent_text
                        text, ids = c.text[sent_text.get(k, 0):], c.token_ids[sent_ids.get(k, 0):]
                        lps = c.logprobs[sent_ids.get(k, 0):] if c.logprobs is not None else None
                        if first and self.req.echo:
                            text = self.prompt_text(out) + text
                            ids = out.prompt_token_ids + ids
                            lps = (out.prompt_logprobs or []) + lps if lps is not None else None
                        if not (text or c.finish_reason or (ids and lps is not None)):
                            continue  # the detokenizer held text back (a possible stop string): nothing to say
                        logprobs = self.logprobs(ids, lps, offsets.get(k, 0)) if lps is not None else None
                        if logprobs is not None:
                            offsets[k] = offsets.get(k, 0) + sum(len(t) for t in logprobs["tokens"])
                        sent_text[k], sent_ids[k] = len(c.text), len(c.token_ids)
                        yield sse({**self.base, "choices": [{"index": k, "text": text, "logprobs": logprobs,
                                                            "finish_reason": c.finish_reason,
                                                            "stop_reason": c.stop_reason}]})
            if self.req.stream_options and self.req.stream_options.include_usage:
                yield sse({**self.base, "choices": [], "usage": self.usage()})
        except APIError as e:  # headers are gone: the error becomes the stream's last event
            yield sse(e.body())
        yield DONE

    def logprobs(self, ids: list[int], lps: list[dict[int, Logprob] | None], offset: int) -> dict:
        """OpenAI's legacy format; a None row (the first prompt token has no logprob) stays None.

        text_offset indexes the choice's text, which omits skipped special tokens (an echoed <bos>): those take
        no room in it."""
        skipped = set(self.tokenizer.all_special_ids) if self.req.skip_special_tokens else set()
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, row in zip(ids, lps):
            tok = row[tid].decoded_token if row else self.tokenizer.decode([tid])
            tokens.append(tok)
            token_lps.append(row[tid].logprob if row else None)
            tops.append({lp.decoded_token: lp.logprob for lp in row.values()} if row else None)
            offsets.append(offset)
            offset += 0 if tid in skipped else len(tok)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

