"""The event-stream and disconnect plumbing of the OpenAI endpoints: SSE framing, a streaming response that
closes its generator however it ends and cuts a client that stops reading, and handlers watched for a
disconnect (which aborts their engine requests)."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from starlette.responses import Response, StreamingResponse

logger = logging.getLogger("vllm.entrypoints.openai")

DONE = "data: [DONE]\n\n"
STALLED_CLIENT_S = 60.0  # a stream whose send blocks this long (the client reads nothing) is cut
STALLED_AT_SHUTDOWN_S = 1.0  # once shutting down, waiting for such a client only delays the exit
STALL_CHECK_S = 0.25


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


class SSEResponse(StreamingResponse):
    """An event stream that closes its generator however the response ends (so a disconnect aborts the engine
    requests now rather than whenever the garbage collector finalizes a generator left suspended at a `yield`),
    and that gives up on a client that stops reading: a send blocked for `stall_limit()` seconds (the client's
    window is full) cuts the stream, so a stalled client can neither hold the server's shutdown nor stay forever."""

    def __init__(self, content: AsyncIterator[str], stall_limit: Callable[[], float]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.stall_limit = stall_limit
        self.cut = False

    async def __call__(self, scope, receive, send) -> None:
        loop = asyncio.get_running_loop()
        sending_since: list[float | None] = [None]

        async def timed_send(message) -> None:
            sending_since[0] = loop.time()
            try:
                await send(message)
            finally:
                sending_since[0] = None

        async def watch(task: asyncio.Task) -> None:
            while True:
                await asyncio.sleep(STALL_CHECK_S)
                since = sending_since[0]
                if since is not None and loop.time() - since > self.stall_limit():
                    self.cut = True
                    task.cancel()
                    return

        watchdog = asyncio.ensure_future(watch(asyncio.current_task()))
        try:
            await super().__call__(scope, receive, timed_send)
        except asyncio.CancelledError:
            if not self.cut:
                raise
            asyncio.current_task().uncancel()  # our own cancel, handled: the task goes on (uvicorn closes up)
            logger.warning("closed a stream whose client stopped reading (a send blocked over %.0f s)",
                           self.stall_limit())
            STALLED_CUTS.note()
        finally:
            watchdog.cancel()
            await self.body_iterator.aclose()


class _QuietCut(logging.Filter):
    """uvicorn reports a response we cut (a stalled client) as an error ("returned without completing"); we have
    said why already, so that one line is dropped, once per cut."""
    MESSAGE = "ASGI callable returned without completing response."

    def __init__(self) -> None:
        super().__init__()
        self.pending = 0

    def note(self) -> None:
        self.pending += 1

    def filter(self, record: logging.LogRecord) -> bool:
        if self.pending and record.getMessage() == self.MESSAGE:
            self.pending -= 1
            return False
        return True


STALLED_CUTS = _QuietCut()
logging.getLogger("uvicorn.error").addFilter(STALLED_CUTS)


async def started(outputs: AsyncIterator) -> AsyncIterator:
    """Waits for the first item (so bad input raises here, before any response) and returns an iterator over
    all of them that closes `outputs` when it is closed (or now, if the wait fails or is cancelled)."""
    try:
        first = await anext(outputs)
    except BaseException:
        await outputs.aclose()
        raise

    async def chain():
        try:
            yield first
            async for x in outputs:
                yield x
        finally:
            await outputs.aclose()
    return chain()


async def stream_when_started(request: Request, outputs: AsyncIterator,
                              stream: Callable[[AsyncIterator], AsyncIterator[str]],
                              stall_limit: Callable[[], float]) -> Response:
    """A streamed answer whose first output may take long (beam search answers once, at its end): the wait
    for it is watched for a disconnect like a whole answer's, which aborts it (499); bad input still raises
    before the response starts."""
    async def start() -> Response:
        return SSEResponse(stream(await started(outputs)), stall_limit)
    return await until_disconnect(request, start())


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
