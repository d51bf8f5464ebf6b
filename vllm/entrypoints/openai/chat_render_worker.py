"""A chat renderer process (chat_render.py starts and stops them): loads the tokenizer, caps its memory and the
rendered prompt's size, then renders the jobs its pipe brings, one at a time."""
from __future__ import annotations

import os
import resource
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

RETIRE_GROWTH_BYTES = 256 << 20  # a renderer left this much larger than it started exits and is replaced
ERROR_CHARS = 1000  # of an exception's message: a template's error can quote the whole prompt


@dataclass(frozen=True)
class RenderLimits:
    timeout_s: float = 10.0
    max_chars: int = 4 << 20
    memory_bytes: int = 2 << 30
    workers: int = 2


@dataclass
class RenderJob:
    """One conversation to render; `output` is "ids" (apply_chat_template's tokens, as LLM.chat), "text" (the
    rendered prompt) or "encoded" (the text tokenized with the tokenizer's special tokens, as /tokenize's
    add_special_tokens asks)."""
    conversation: list[dict]
    chat_template: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    output: Literal["ids", "text", "encoded"] = "ids"
    from_request: bool = False  # the template came with the request (errors then name its field)


class RenderedTooLong(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the rendered prompt is over the limit of {limit} characters: the chat template writes "
                         "more text than any prompt can hold")


def serve(conn, load_tokenizer: Callable[[], Any], limits: RenderLimits) -> None:
    """A renderer's main: loads the tokenizer, caps memory and output, then renders jobs until its pipe closes."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the server stops us
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # no thread pool: one render at a time, memory predictable
    try:
        tokenizer = load_tokenizer()
        _bound_output(limits.max_chars)
        _warm_up(tokenizer)
        _limit_memory(limits.memory_bytes)
    except BaseException as e:  # noqa: BLE001 - reported to the server, which answers the request with it
        conn.send(("failed", _describe(e)))
        return
    baseline = _rss()
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        reply = _handle(tokenizer, job, baseline, limits.memory_bytes)
        conn.send(reply)
        if reply[-1]:
            return


def _handle(tokenizer, job: RenderJob, baseline: int | None, memory_bytes: int) -> tuple:
    """("ok", result, retire) or ("error", status, message, param, retire)."""
    try:
        result = render_job(tokenizer, job)
    except RenderedTooLong as e:
        return "error", 400, str(e), "messages", False
    except MemoryError:  # the process may be left fragmented: it exits, a fresh one takes its place
        return "error", 400, ("rendering the chat template needed more memory than the renderer's limit of "
                              f"{memory_bytes >> 20} MiB"), "messages", True
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001 - whatever the template raised is about these messages
        return "error", 400, f"messages could not be rendered by the chat template: {_describe(e)}", "messages", \
            False
    rss = _rss()
    return "ok", result, baseline is not None and rss is not None and rss > baseline + RETIRE_GROWTH_BYTES


def render_job(tokenizer, job: RenderJob) -> list[int] | str:
    """What LLM.chat does with the conversation (apply_chat_template, tokenize=True, ids out of the encoding),
    or the rendered text."""
    out = tokenizer.apply_chat_template(job.conversation, tools=job.tools, chat_template=job.chat_template,
                                        add_generation_prompt=job.add_generation_prompt,
                                        continue_final_message=job.continue_final_message,
                                        tokenize=job.output == "ids", **job.kwargs)
    if job.output == "text":
        return out
    if job.output == "encoded":
        return tokenizer.encode(out, add_special_tokens=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _describe(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS] + f"... ({len(text)} characters)"


def _bound_output(max_chars: int) -> None:
    """Every sandboxed template this process renders stops at `max_chars` of output, piece by piece, before a
    looping template has built a huge prompt (Template.render joins its pieces with the environment's concat)."""
    from jinja2.sandbox import SandboxedEnvironment

    def concat(pieces) -> str:
        out, size = [], 0
        for piece in pieces:
            size += len(piece)
            if size > max_chars:
                raise RenderedTooLong(max_chars)
            out.append(piece)
        return "".join(out)
    SandboxedEnvironment.concat = staticmethod(concat)


def _warm_up(tokenizer) -> None:
    """One render and encode before the memory limit, so what they set up once counts in the baseline."""
    try:
        render_job(tokenizer, RenderJob([{"role": "user", "content": "Hi"}]))
    except Exception:  # noqa: BLE001 - a tokenizer without a template of its own: requests bring one
        tokenizer.encode("Hi")


def _limit_memory(budget: int) -> None:
    """RLIMIT_AS: the address space now plus `budget`; past it allocations fail (MemoryError) in this process."""
    size = _statm(0)
    if size is None:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + budget if hard == resource.RLIM_INFINITY else min(size + budget, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _rss() -> int | None:
    return _statm(1)


def _statm(index: int) -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[index]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _die_with_parent() -> None:
    """SIGKILL when the forkserver (our parent) exits, which it does when the server does, even a killed one."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass
