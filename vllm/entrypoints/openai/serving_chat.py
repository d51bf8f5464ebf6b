"""POST /v1/chat/completions: messages through the tokenizer's chat template, answered whole or as
chat.completion.chunk events."""
from __future__ import annotations

import dataclasses
import functools
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Literal

from fastapi import Request
from starlette.responses import JSONResponse, Response

from vllm.entrypoints.llm import text_content
from vllm.entrypoints.openai.chat_render import (ChatRenderer, RenderJob, RenderLimits, check_template_fields,
                                                 reserved_kwargs)
from vllm.entrypoints.openai.chat_tools import (ChoiceParser, ConstrainedCalls, check_tool_settings, forced_prefix,
                                                tool_call_constraint, tool_choice_mode)
from vllm.entrypoints.openai.metrics import Metrics
from vllm.entrypoints.openai.protocol import APIError, ChatCompletionRequest, TokenizeRequest
from vllm.entrypoints.openai.serving_engine import OpenAIServing, ServerSettings, prompt_logprobs_json
from vllm.entrypoints.openai.sse import DONE, SSEResponse, sse, started, stream_when_started, until_disconnect
from vllm.outputs import Logprob, OutputJoiner
from vllm.structured_output.params import StructuredOutputsParams
from vllm.transformers_utils.tokenizer import get_tokenizer

ROLE = "assistant"  # the role of every answer
# The keys of OpenAI's chat message that this server never fills: present and empty, as in upstream's answers,
# so that a client's parsed model and the raw JSON hold the same keys.
EMPTY_MESSAGE_FIELDS = {"refusal": None, "annotations": None, "audio": None, "function_call": None, "tool_calls": []}
PROMPT_TAIL_TOKENS = 16  # of the prompt, decoded to see whether it opens the answer's thinking


@dataclass(slots=True)
class ChatRun:
    """A chat request started: its (request id, RequestOutput) stream and each choice's parser."""
    outputs: AsyncIterator
    parsers: list[ChoiceParser]
    beam: bool  # beam search: every choice comes at once, at the end


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine, settings: ServerSettings, metrics: Metrics) -> None:
        super().__init__(engine, settings, metrics)
        mc = engine.config.model_config
        # The tokenizer the engine and LLM.chat load, loaded again in each renderer process (chat_render.py).
        load = functools.partial(get_tokenizer, mc.tokenizer, trust_remote_code=mc.trust_remote_code)
        self.renderer = ChatRenderer(load, RenderLimits(timeout_s=settings.chat_template_timeout_s))
        self.renderer.start()
        self.reserved_kwargs = reserved_kwargs(engine.tokenizer)

    async def prompt_ids(self, req: ChatCompletionRequest | TokenizeRequest,
                         output: Literal["ids", "text", "encoded"] = "ids") -> list[int] | str:
        """Token ids exactly as `LLM.chat` builds them, so the server and offline runs agree (or the rendered text,
        or that text tokenized with the tokenizer's special tokens: chat_render.RenderJob); rendered in a renderer
        process, bounded in time and size. The request's template (with --trust-request-chat-template) beats
        --chat-template, which beats the tokenizer's own."""
        check_template_fields(req.chat_template, req.chat_template_kwargs, self.settings.trust_request_chat_template,
                              self.reserved_kwargs)
        # exclude_none drops unset optional fields; a null content comes back as "" (text_content)
        job = RenderJob(conversation=[text_content(m.model_dump(exclude_none=True)) for m in req.messages],
                        chat_template=req.chat_template or self.settings.chat_template,
                        kwargs=dict(req.chat_template_kwargs or {}),
                        # the template renders them (transformers' `tools` argument)
                        tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
                        add_generation_prompt=req.add_generation_prompt,
                        continue_final_message=req.continue_final_message, output=output,
                        from_request=bool(req.chat_template))
        return await self.renderer.render(job)

    async def prepare(self, req: ChatCompletionRequest, request_id: str) -> ChatRun:
        """Checks the request, renders its prompt and starts generating: the outputs and each choice's parser (the
        Responses API, serving_responses.py, answers from the same). Bad input raises APIError before anything
        runs."""
        self.check_model(req.model)
        self.check_logprobs("top_logprobs", req.top_logprobs if req.logprobs else None)
        self.check_logprobs("prompt_logprobs", req.prompt_logprobs)
        tools = self.settings.tools
        try:
            request_tools = [t.model_dump() for t in req.tools or []]
            mode, name = tool_choice_mode(request_tools, req.tool_choice)
            check_tool_settings(mode, tools)
            constraint = tool_call_constraint(mode, name, request_tools, req.parallel_tool_calls)
            if constraint is not None and req.structured_outputs_params() is not None:
                raise ValueError(f'tool_choice "{mode}" constrains the answer to tool calls: it does not combine '
                                 "with response_format or structured_outputs")
        except ValueError as e:
            raise APIError(400, str(e), "tool_choice") from None
        ids = await self.prompt_ids(req)
        if req.truncate_prompt_tokens is not None:
            ids = ids[-req.truncate_prompt_tokens:]
        prefix = forced_prefix(mode, name)
        if prefix:  # the answer starts inside the tool-call section: the prompt ends with its opening
            ids = ids + self.engine.tokenizer.encode(prefix, add_special_tokens=False)
        max_tokens = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
        try:
            params = req.sampling_params(max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                                         defaults=self.default_sampling)
            beam = req.beam_search_params(max_tokens) if req.use_beam_search else None
            if constraint is not None:
                params = dataclasses.replace(params, structured_outputs=StructuredOutputsParams.from_dict(constraint))
        except ValueError as e:
            raise self.error(e) from None
        parse_tools = mode != "none" and tools.tool_parser is not None
        if (parse_tools or tools.reasoning_parser is not None) and constraint is None:
            # The markers the parsers read are special tokens: the text must keep them (a constrained answer
            # has none, and its stop token must not reach the JSON).
            params = dataclasses.replace(params, skip_special_tokens=False)
        prompt_text = self.engine.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:]) if tools.reasoning_parser else ""
        parsers = [ChoiceParser(tools, parse_tools, prompt_text, prefix,
                                ConstrainedCalls(mode, name) if constraint is not None else None)
                   for _ in range(req.n)]
        self.log_request(request_id, ids, params)
        prompts = [{"prompt_token_ids": ids}]
        # Beam search answers once, with every beam (best first) as a choice; streamed, as one delta each.
        outputs = self.beam_search(prompts, beam, request_id, params.logprobs, params.prompt_logprobs) \
            if beam is not None else self.generate(prompts, params, request_id)
        return ChatRun(outputs, parsers, beam is not None)

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        run = await self.prepare(req, request_id)
        base = {"id": request_id, "created": int(time.time()), "model": self.model_name}
        outputs, parsers = run.outputs, run.parsers
        if req.stream and run.beam:  # the beams come at the search's end: a disconnect before then aborts it
            return await stream_when_started(raw, outputs, lambda outs: self.stream(req, outs, base, parsers),
                                             self.stall_limit)
        if req.stream:  # bad input raises before the response starts
            return SSEResponse(self.stream(req, await started(outputs), base, parsers), self.stall_limit)
        return await until_disconnect(raw, self.full(req, outputs, base, parsers))

    @staticmethod
    def echoed(req: ChatCompletionRequest) -> str:
        """With echo, the answer starts with the last message's content when that message has the answer's role."""
        last = req.messages[-1]
        return (last.content or "") if req.echo and last.role == ROLE else ""

    async def full(self, req: ChatCompletionRequest, outputs, base: dict, parsers: list[ChoiceParser]) -> Response:
        joined = OutputJoiner()
        async with aclosing(outputs):
            async for _, out in outputs:
                joined.add(out)
        last = joined.pop()
        echo = self.echoed(req)
        choices = []
        for c in last.outputs:
            message = {"role": ROLE, "content": echo + c.text}
            finish_reason = c.finish_reason
            if parsers[c.index].active:
                message = {"role": ROLE, **parsers[c.index].message(c.text)}
                if echo:
                    message["content"] = echo + (message["content"] or "")
                if "tool_calls" in message and finish_reason == "stop":
                    finish_reason = "tool_calls"
            choice = {"index": c.index, "message": {**EMPTY_MESSAGE_FIELDS, **message},
                      "logprobs": self.logprobs(req, c.token_ids, c.logprobs),
                      "finish_reason": finish_reason, "stop_reason": c.stop_reason}
            if req.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        body = {**base, "object": "chat.completion", "choices": choices,
                "usage": self.settings.usage(len(last.prompt_token_ids), sum(len(c.token_ids) for c in last.outputs),
                                             last.num_cached_tokens),
                "service_tier": None, "system_fingerprint": None}  # OpenAI's, null as in upstream's answers
        if req.return_token_ids:
            body["prompt_token_ids"] = last.prompt_token_ids
        # prompt_logprobs is always a key (null unless asked for), as in upstream's responses.
        body["prompt_logprobs"] = prompt_logprobs_json(last.prompt_logprobs) if req.prompt_logprobs is not None \
            else None
        return JSONResponse(body)

    async def stream(self, req: ChatCompletionRequest, outputs, base: dict, parsers: list[ChoiceParser]):
        base = {**base, "object": "chat.completion.chunk"}
        prompt_tokens, completion_tokens, cached_tokens = 0, 0, 0
        final_usage, continuous = self.include_usage(req)
        echo = self.echoed(req)
        try:
            first = True
            async with aclosing(outputs):
                async for _, out in outputs:  # deltas: each piece of text, ids and logprobs comes once
                    prompt_tokens, cached_tokens = len(out.prompt_token_ids), out.num_cached_tokens
                    if first:  # the role chunk, with what belongs to the prompt
                        first = False
                        chunk = {**base, "choices": [{"index": i, "delta": {"role": ROLE, "content": echo},
                                                      "logprobs": None, "finish_reason": None}
                                                     for i in range(req.n)]}
                        if req.return_token_ids:
                            chunk["prompt_token_ids"] = out.prompt_token_ids
                        if req.prompt_logprobs is not None:
                            chunk["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
                        yield sse(self._with_usage(chunk, continuous, prompt_tokens, completion_tokens, cached_tokens))
                    for c in out.outputs:
                        completion_tokens += len(c.token_ids)
                        parser = parsers[c.index]
                        delta = parser.delta(c.text, c.finish_reason is not None) if parser.active else \
                            ({"content": c.text} if c.text else {})
                        if not (delta or c.finish_reason or (c.token_ids and c.logprobs is not None)):
                            continue  # text held back (a stop string, a marker) and no logprobs to send
                        finish_reason = c.finish_reason
                        if finish_reason == "stop" and parser.called_tools:
                            finish_reason = "tool_calls"
                        choice = {"index": c.index, "delta": delta,
                                  "logprobs": self.logprobs(req, c.token_ids, c.logprobs),
                                  "finish_reason": finish_reason, "stop_reason": c.stop_reason}
                        if req.return_token_ids:
                            choice["token_ids"] = c.token_ids
                        yield sse(self._with_usage({**base, "choices": [choice]}, continuous, prompt_tokens,
                                                   completion_tokens, cached_tokens))
            if final_usage:
                yield sse({**base, "choices": [], "usage": self.settings.usage(prompt_tokens, completion_tokens,
                                                                                cached_tokens)})
        except APIError as e:  # headers are gone: the error becomes the stream's last event
            yield sse(e.body())
        yield DONE

    def _with_usage(self, chunk: dict, continuous: bool, prompt_tokens: int, completion_tokens: int,
                    cached_tokens: int) -> dict:
        if continuous:
            chunk["usage"] = self.settings.usage(prompt_tokens, completion_tokens, cached_tokens)
        return chunk

    def logprobs(self, req: ChatCompletionRequest, ids: list[int],
                 rows: list[dict[int, Logprob]] | None) -> dict | None:
        if rows is None:
            return None
        k = req.top_logprobs
        if k == -1:  # the whole vocabulary: every entry of the row
            k = max(lp.rank for row in rows for lp in row.values()) if rows else 0

        def entry(tid: int, lp: Logprob) -> dict:
            token = self.token_label(req, tid, lp.decoded_token)
            return {"token": token, "logprob": lp.logprob, "bytes": list(lp.decoded_token.encode())}
        # A row holds the sampled token (any rank) and the top k (ranks 1..k); top_logprobs is the top k.
        return {"content": [{**entry(tid, row[tid]), "top_logprobs": [
            entry(t, lp) for t, lp in sorted(row.items(), key=lambda item: item[1].rank) if lp.rank <= (k or 0)]}
            for tid, row in zip(ids, rows)]}
