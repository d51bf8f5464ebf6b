"""What the completion and chat endpoints share: model-name checks, request logging, running several prompts
as engine requests with metrics, error mapping, and the SSE / disconnect plumbing."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

from fastapi import Request
from starlette.responses import Response, StreamingResponse

from vllm.entrypoints.openai.metrics import Metrics
from vllm.entrypoints.openai.protocol import APIError
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams

logger = logging.getLogger("vllm.entrypoints.openai")

DONE = "data: [DONE]\n\n"
_PARAM_NAMES = frozenset(SamplingParams.__dataclass_fields__) | {"prompt_token_ids"}


@dataclass(slots=True)
class ServerSettings:
    served_model_names: list[str]
    max_log_len: int | None = None
    log_requests: bool = True
    max_body_bytes: int = 1 << 20
    api_key: str | None = None


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class SSEResponse(StreamingResponse):
    """Closes its generator however the response ends, so a disconnect aborts the engine requests now rather
    than whenever the garbage collector finalizes a generator left suspended at a `yield`."""

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class OpenAIServing:
    def __init__(self, engine, settings: ServerSettings, metrics: Metrics) -> None:
        self.engine, self.settings, self.metrics = engine, settings, metrics
        self.shutting_down = False

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.settings.served_model_names:
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

    async def generate(self, prompts: list[str | list[int] | dict], params: SamplingParams,
                       request_id: str) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, cumulative output) for each prompt, each run as its own engine request.

        Nothing is yielded until every prompt has produced its first output, so a bad prompt among several
        raises (as an APIError) before a response has started. Closing this generator aborts what is running.
        """
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in gen:
                    queue.put_nowait((i, out))
            except Exception as e:  # noqa: BLE001 - handed to the consumer, which maps it
                queue.put_nowait((i, e))

        tasks = [asyncio.create_task(pump(i, self.engine.generate(p, params, f"{request_id}-{i}")))
                 for i, p in enumerate(prompts)]
        timers = [self.metrics.timer() for _ in prompts]
        held: list | None = []
        seen: set[int] = set()
        finished = 0
        try:
            while finished < len(prompts):
                i, item = await queue.get()
                if isinstance(item, Exception):
                    raise self.error(item)
                timers[i].update(max(len(c.token_ids) for c in item.outputs))
                if item.finished:
                    finished += 1
                    timers[i].finish([c.finish_reason for c in item.outputs])
                    if any(c.finish_reason == "abort" for c in item.outputs):
                        # Only shutdown aborts a request whose client is still listening.
                        raise APIError(503, "the server is shutting down; the request was aborted")
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


async def started(outputs: AsyncIterator) -> AsyncIterator:
    """Waits for the first item (so bad input raises here, before any response) and returns an iterator over
    all of them that closes `outputs` when it is closed."""
    first = await anext(outputs)

    async def chain():
        try:
            yield first
            async for x in outputs:
                yield x
        finally:
            await outputs.aclose()
    return chain()


async def until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Runs a non-streaming handler's work but cancels it (aborting its engine requests) if the client leaves."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
    return task.result()
