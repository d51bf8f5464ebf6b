"""The Responses API's request body (POST /v1/responses) and its translation into the chat completion that
answers it: `input` items and `instructions` become messages, function tools and `tool_choice` their chat forms,
`text.format` the response_format. What cannot be answered (non-function tools, non-text input parts) is a 400
naming it."""
from __future__ import annotations

from typing import Any

from pydantic import Field

from vllm.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIBaseModel

_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(OpenAIBaseModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    stream: bool = False
    store: bool = True
    metadata: dict[str, Any] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None  # accepted: the model thinks as its chat template says
    # As on chat completions (vLLM's extras): the template's variables, and a template of the request's own.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"),
                                                                                                   str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{where}.content[{i}]: only text parts ({', '.join(_TEXT_PARTS)}) are supported, "
                                 f"got {kind!r}")
            out.append(part["text"])
        return "".join(out)
    raise ValueError(f"{where}.content must be a string or a list of text parts")


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages for `input`: messages as they are, function calls as an assistant turn's tool_calls (calls
    in a row share one turn), their outputs as tool messages; reasoning items are dropped (the template does not
    take them back)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ValueError(f"{where}.role must be user, assistant, system or developer, got {role!r}")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            if not all(isinstance(v, str) for v in (call["id"], call["function"]["name"])):
                raise ValueError(f"{where}: a function_call needs call_id and name")
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise ValueError(f"{where}: a function_call_output needs call_id")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str) else _text(output, where)})
        elif kind != "reasoning":
            raise ValueError(f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                             "function_call_output and reasoning are)")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise ValueError(f"tools[{i}]: only function tools (with a name) are supported, got {kind!r}")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                     if t.get(k) is not None}})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    return {"type": fmt.get("type")}


def to_chat(req: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[ChatCompletionRequest,
                                                                            list[dict[str, Any]]]:
    """The chat completion that answers `req` after `history` (the messages of previous_response_id's
    conversation), and the conversation's messages to store with the answer (without instructions, which do not
    carry over, as OpenAI's)."""
    conversation = history + input_messages(req.input)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    body = {"model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "tools": chat_tools(req.tools),
            "tool_choice": chat_tool_choice(req.tool_choice) if req.tools else None,
            "parallel_tool_calls": req.parallel_tool_calls, "response_format": response_format(req.text),
            "stream": req.stream, "chat_template": req.chat_template,
            "chat_template_kwargs": req.chat_template_kwargs}
    return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None}), conversation
