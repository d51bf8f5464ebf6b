"""POST /v1/chat/completions: messages through the tokenizer's chat template, answered whole or as
chat.completion.chunk events."""
from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing

from fastapi import Request
from starlette.responses import JSONResponse, Response

from vllm.entrypoints.openai.protocol import APIError, ChatCompletionRequest, ChatMessage
from vllm.entrypoints.openai.serving_engine import (DONE, OpenAIServing, SSEResponse, sse, started,
                                                    until_disconnect, usage)
from vllm.outputs import Logprob, OutputJoiner


class OpenAIServingChat(OpenAIServing):
    async def prompt_ids(self, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
        """Token ids exactly as `LLM.chat` builds them, so the server and offline runs agree; rendered and
        tokenized in a worker thread, off the event loop."""
        conversation = [m.model_dump(exclude_none=True) for m in messages]
        try:
            ids = await asyncio.to_thread(self.engine.tokenizer.apply_chat_template, conversation,
                                          add_generation_prompt=add_generation_prompt, tokenize=True)
        except Exception as e:  # noqa: BLE001 - a template error is about these messages
            raise APIError(400, f"messages could not be rendered by the chat template: {e}", "messages") from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        ids = await self.prompt_ids(req.messages, req.add_generation_prompt)
        max_tokens = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
        try:
            params = req.sampling_params(max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        except ValueError as e:
            raise self.error(e) from None
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        self.log_request(request_id, ids, params)
        base = {"id": request_id, "created": int(time.time()), "model": self.model_name}
        outputs = self.generate([{"prompt_token_ids": ids}], params, request_id)
        if req.stream:  # bad input raises before the response starts
            return SSEResponse(self.stream(req, await started(outputs), base), self.stall_limit)
        return await until_disconnect(raw, self.full(req, outputs, base))

    async def full(self, req: ChatCompletionRequest, outputs, base: dict) -> Response:
        joined = OutputJoiner()
        async with aclosing(outputs):
            async for _, out in outputs:
                joined.add(out)
        last = joined.pop()
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self.logprobs(c.token_ids, c.logprobs, req.top_logprobs),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in last.outputs]
        return JSONResponse({**base, "object": "chat.completion", "choices": choices,
                             "usage": usage(len(last.prompt_token_ids), sum(len(c.token_ids) for c in last.outputs))})

    async def stream(self, req: ChatCompletionRequest, outputs, base: dict):
        base = {**base, "object": "chat.completion.chunk"}
        prompt_tokens, completion_tokens = 0, 0
        try:
            yield sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None} for i in range(req.n)]})
            async with aclosing(outputs):
                async for _, out in outputs:  # deltas: each piece of text, ids and logprobs comes once
                    prompt_tokens = len(out.prompt_token_ids)
                    for c in out.outputs:
                        completion_tokens += len(c.token_ids)
                        if not (c.text or c.finish_reason or (c.token_ids and c.logprobs is not None)):
                            continue  # text held back (a possible stop string) and no logprobs to send
                        yield sse({**base, "choices": [{
                            "index": c.index, "delta": {"content": c.text} if c.text else {},
                            "logprobs": self.logprobs(c.token_ids, c.logprobs, req.top_logprobs),
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]})
            if req.stream_options and req.stream_options.include_usage:
                yield sse({**base, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
        except APIError as e:  # headers are gone: the error becomes the stream's last event
            yield sse(e.body())
        yield DONE

    @staticmethod
    def logprobs(ids: list[int], rows: list[dict[int, Logprob]] | None, k: int | None) -> dict | None:
        if rows is None:
            return None

        def entry(lp: Logprob) -> dict:
            return {"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list(lp.decoded_token.encode())}
        # A row holds the sampled token (any rank) and the top k (ranks 1..k); top_logprobs is the top k.
        return {"content": [{**entry(row[tid]), "top_logprobs": [
            entry(lp) for lp in sorted(row.values(), key=lambda lp: lp.rank) if lp.rank <= (k or 0)]}
            for tid, row in zip(ids, rows)]}
