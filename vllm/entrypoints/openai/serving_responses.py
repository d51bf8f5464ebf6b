"""POST /v1/responses (OpenAI's Responses API, what `client.responses.create` calls) and GET /v1/responses/{id}.

A response is answered by the chat path (serving_chat.prepare: the chat template, tools, parsers, structured
outputs): its thinking becomes a `reasoning` item, its text a `message` item with one `output_text` part, each
tool call a `function_call` item whose `call_id` is the call's id. Streamed, the same items come as OpenAI's
typed events (`response.created`, `response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`, ..., `response.completed`), each with its `sequence_number`.

With `store` (the default), the response and its conversation are kept (response_store.py: the last
MAX_STORED, in memory, or in a directory that several API server processes share), so `previous_response_id`
continues it and GET returns it; an unknown id is a 404.
"""
from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing
from typing import Any

from fastapi import Request
from starlette.responses import JSONResponse, Response

from vllm.entrypoints.openai.protocol import APIError
from vllm.entrypoints.openai.response_store import MAX_STORED, MemoryResponseStore, SharedResponseStore
from vllm.entrypoints.openai.responses_protocol import ResponsesRequest, to_chat
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.sse import SSEResponse, started, until_disconnect
from vllm.outputs import OutputJoiner

def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """The output items of one answer, fed the chat parser's message fields (whole or as stream deltas); in
    streaming mode it also returns the events each piece adds."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item the latest delta went to
        self.seq = 0

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _start(self, item: dict) -> list[dict]:
        events = self._close()
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        events.append(self.event("response.output_item.added", output_index=index, item=_in_progress(item)))
        if item["type"] == "message":
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                     content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def _close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events += [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"], logprobs=[]),
                       self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part)]
        elif item["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=item["content"][0]["text"]))
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, name=item["name"], arguments=item["arguments"]))
        return events + [self.event("response.output_item.done", output_index=index, item=item)]

    def add(self, fields: dict) -> list[dict]:
        """Message fields (reasoning_content, content, tool_calls) of the answer or of a delta, in order."""
        events: list[dict] = []
        if fields.get("reasoning_content"):
            if self.open is None or self.open["type"] != "reasoning":
                events += self._start({"id": _id("rs"), "type": "reasoning", "summary": [], "status": "completed",
                                       "content": [{"type": "reasoning_text", "text": ""}]})
            self.open["content"][0]["text"] += fields["reasoning_content"]
            events.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                     output_index=len(self.items) - 1, content_index=0,
                                     delta=fields["reasoning_content"]))
        if fields.get("content"):
            if self.open is None or self.open["type"] != "message":
                events += self._start({"id": _id("msg"), "type": "message", "role": "assistant",
                                       "status": "completed",
                                       "content": [{"type": "output_text", "text": "", "annotations": [],
                                                    "logprobs": []}]})
            self.open["content"][0]["text"] += fields["content"]
            events.append(self.event("response.output_text.delta", item_id=self.open["id"],
                                     output_index=len(self.items) - 1, content_index=0, delta=fields["content"],
                                     logprobs=[]))
        for call in fields.get("tool_calls") or []:
            fn = call["function"]
            if "id" in call:  # a call's first piece (or the whole call) names it
                events += self._start({"id": _id("fc"), "type": "function_call", "call_id": call["id"],
                                       "name": fn["name"], "arguments": "", "status": "completed"})
            if fn.get("arguments"):
                self.open["arguments"] += fn["arguments"]
                events.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                         output_index=len(self.items) - 1, delta=fn["arguments"]))
        return events

    def finish(self) -> list[dict]:
        return self._close()


def _in_progress(item: dict) -> dict:
    """An item as output_item.added shows it: empty, in progress."""
    out = {**item, "status": "in_progress"}
    if item["type"] == "message":
        out["content"] = []
    elif item["type"] == "function_call":
        out["arguments"] = ""
    elif item["type"] == "reasoning":
        out["content"] = []
    return out


def conversation_tail(items: list[dict]) -> list[dict]:
    """The answer's items as the chat messages a continuation renders (thinking is not carried over)."""
    text = "".join(i["content"][0]["text"] for i in items if i["type"] == "message")
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in items if i["type"] == "function_call"]
    return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: MemoryResponseStore | SharedResponseStore) -> None:
        self.chat, self.store = chat, store

    async def get(self, response_id: str) -> dict:
        entry = await self.store.get(response_id)
        if entry is None:
            raise APIError(404, f"no stored response with id {response_id!r}", "response_id")
        return entry[0]

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        history: list[dict] = []
        if req.previous_response_id is not None:
            entry = await self.store.get(req.previous_response_id)
            if entry is None:
                raise APIError(404, f"previous_response_id {req.previous_response_id!r} is not a stored response "
                               f"(the server keeps the last {MAX_STORED} responses with store true)",
                               "previous_response_id")
            history = entry[1]
        try:
            chat_req, conversation = to_chat(req, history)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        response_id = _id("resp")
        run = await self.chat.prepare(chat_req, response_id)
        base = self._base(req, response_id)
        if req.stream:
            return SSEResponse(self._stream(req, await started(run.outputs), run.parsers[0], base, conversation),
                               self.chat.stall_limit)
        return await until_disconnect(raw, self._full(req, run.outputs, run.parsers[0], base, conversation))

    def _base(self, req: ResponsesRequest, response_id: str) -> dict:
        return {"id": response_id, "object": "response", "created_at": int(time.time()),
                "model": self.chat.model_name, "status": "in_progress", "output": [], "error": None,
                "incomplete_details": None, "instructions": req.instructions, "metadata": req.metadata or {},
                "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
                "tools": req.tools or [], "tool_choice": req.tool_choice,
                "parallel_tool_calls": req.parallel_tool_calls,
                "previous_response_id": req.previous_response_id, "store": req.store,
                "text": req.text or {"format": {"type": "text"}}, "usage": None}

    async def _done(self, req: ResponsesRequest, base: dict, items: list[dict], last, conversation: list[dict]
                    ) -> dict:
        c = last.outputs[0]
        status, details, error = "completed", None, None
        if c.finish_reason == "length":
            status, details = "incomplete", {"reason": "max_output_tokens"}
        elif c.finish_reason in ("error", "abort"):
            status, error = "failed", {"code": "server_error", "message": last.error or "the request was aborted"}
        thought = "".join(i["content"][0]["text"] for i in items if i["type"] == "reasoning")
        reasoning = len(self.chat.engine.tokenizer.encode(thought, add_special_tokens=False)) if thought else 0
        prompt, output = len(last.prompt_token_ids), len(c.token_ids)
        body = {**base, "status": status, "incomplete_details": details, "error": error, "output": items,
                "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": last.num_cached_tokens},
                          "output_tokens": output, "output_tokens_details": {"reasoning_tokens": reasoning},
                          "total_tokens": prompt + output}}
        if req.store:
            await self.store.put(base["id"], (body, conversation + conversation_tail(items)))
        return body

    async def _full(self, req, outputs, parser, base, conversation) -> Response:
        joined = OutputJoiner()
        async with aclosing(outputs):
            async for _, out in outputs:
                joined.add(out)
        last = joined.pop()
        builder = ResponseBuilder()
        builder.add(parser.message(last.outputs[0].text))
        builder.finish()
        return JSONResponse(await self._done(req, base, builder.items, last, conversation))

    async def _stream(self, req, outputs, parser, base, conversation):
        builder = ResponseBuilder()
        yield _sse(builder.event("response.created", response=base))
        yield _sse(builder.event("response.in_progress", response=base))
        joined = OutputJoiner()
        async with aclosing(outputs):
            async for _, out in outputs:
                joined.add(out)
                c = out.outputs[0]
                for e in builder.add(parser.delta(c.text, c.finish_reason is not None) if parser.active
                                     else {"content": c.text}):
                    yield _sse(e)
        for e in builder.finish():
            yield _sse(e)
        body = await self._done(req, base, builder.items, joined.pop(), conversation)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(body["status"],
                                                                                            "response.failed")
        yield _sse(builder.event(kind, response=body))


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'), ensure_ascii=False)}\n\n"
