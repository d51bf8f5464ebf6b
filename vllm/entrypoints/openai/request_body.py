"""Request bodies, read and parsed here rather than by FastAPI so that every client mistake (wrong content type,
oversized or malformed body, bad field) becomes one OpenAI-shaped error with the right status."""
from __future__ import annotations

import json
import logging

from fastapi import Request
from pydantic import BaseModel, ValidationError

from vllm.entrypoints.openai.protocol import APIError, ignored_fields, validation_error
from vllm.inputs.validation import LONE_SURROGATE

logger = logging.getLogger("vllm.entrypoints.openai")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def parse_body(request: Request, model: type[BaseModel], limit: int) -> BaseModel:
    return validate_body(await read_body(request, limit), model)


async def read_body(request: Request, limit: int) -> dict:
    """The request's JSON object, or the APIError that says what is wrong with it."""
    ctype = request.headers.get("content-type", "")
    if ctype.split(";")[0].strip().lower() != "application/json":
        raise APIError(400, f"Content-Type must be application/json, got {ctype!r}")
    body = bytearray()
    async for chunk in request.stream():  # a chunked body has no Content-Length: count as it arrives
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"the request body is over the limit of {limit} bytes (--max-request-body-bytes)")
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "the request body nests arrays or objects too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    if (where := _lone_surrogate(data)) is not None:
        raise APIError(400, f"{where or 'the request body'} holds a lone UTF-16 surrogate (such as \\ud800), "
                            "which is not a character: send valid Unicode text", where or None)
    return data


def validate_body(data: dict, model: type[BaseModel]) -> BaseModel:
    """`data` as `model`, or a 400 naming the field; unknown fields are logged (they are ignored)."""
    try:
        parsed = model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    except RecursionError:
        raise APIError(400, "the request body nests arrays or objects too deeply") from None
    if ignored := ignored_fields(parsed):
        logger.warning("The following fields were present in the request but ignored: %s", sorted(ignored))
    return parsed


def _lone_surrogate(data) -> str | None:
    """The dotted path of the first string (key or value) holding a lone surrogate, "" for the body itself;
    None when every string is valid Unicode. JSON allows "\\ud800", but it cannot be tokenized nor sent back."""
    stack = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if LONE_SURROGATE.search(value):
                return path
        elif isinstance(value, dict):
            for k, v in value.items():
                key_path = f"{path}.{k}".lstrip(".")
                if LONE_SURROGATE.search(k):
                    return path
                stack.append((key_path, v))
        elif isinstance(value, list):
            # Only strings and containers can hold a surrogate: a prompt of token ids (100K of them in an agent's
            # context) builds no paths (it took 31 ms per 100K ids, on the event loop).
            if not set(map(type, value)) <= _SCALARS:
                stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value) if type(v) not in _SCALARS)
    return None


_SCALARS = frozenset({int, float, bool, type(None)})
