"""Hostile chat templates and template arguments (issue 46): a request's template needs
--trust-request-chat-template, chat_template_kwargs holds template variables only, every route but the probes
needs the API key, and renders run in renderer processes bounded in time, output and memory, so that a looping or
huge template gets a 400 without holding up other requests, and SIGTERM still stops the server at once."""
from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.openai.protocol import APIError
from vllm.transformers_utils.tokenizer import get_tokenizer

KEY = "test-key-46"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT_S = 5  # --chat-template-timeout of the trusting server: above a chat's latency on a loaded 2-core box
MESSAGES = [{"role": "user", "content": "Hi"}]
TEMPLATE = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HUGE = "{% for i in range(100000) %}{% for j in range(1000) %}xxxxxxxxxx{% endfor %}{% endfor %}"
GREEDY = "{{ 'x' * 10 ** 11 }}"  # one 100 GB string


@pytest.fixture(scope="module")
def servers(start_server):
    """(keyed, trusting): started side by side, as each takes seconds to load."""
    with ThreadPoolExecutor(2) as pool:
        keyed = pool.submit(start_server, "--api-key", KEY)
        trusting = pool.submit(start_server, "--trust-request-chat-template", "--chat-template-timeout",
                               str(TIMEOUT_S))
        return keyed.result(), trusting.result()


@pytest.fixture(scope="module")
def keyed(servers):
    with httpx.Client(base_url=servers[0].url, headers=AUTH, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def trusting(servers):
    with httpx.Client(base_url=servers[1].url, timeout=60) as c:
        yield c


def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# ---- without a server ------------------------------------------------------------------------------------------

def test_check_template_fields_refuses_untrusted_templates_and_reserved_kwargs():
    from vllm.entrypoints.openai.chat_render import RESERVED_KWARGS, check_template_fields
    with pytest.raises(APIError, match="--trust-request-chat-template"):
        check_template_fields(TEMPLATE, None, False, RESERVED_KWARGS)
    with pytest.raises(APIError, match="--trust-request-chat-template"):
        check_template_fields(None, {"chat_template": TEMPLATE}, False, RESERVED_KWARGS)
    check_template_fields(TEMPLATE, {"greeting": "hi"}, True, RESERVED_KWARGS)
    with pytest.raises(APIError, match=r"chat_template_kwargs\.return_tensors is not allowed") as e:
        check_template_fields(None, {"return_tensors": "pt"}, True, RESERVED_KWARGS)
    assert e.value.status == 400


def test_reserved_kwargs_hold_the_tokenizers_own_arguments():
    from vllm.entrypoints.openai.chat_render import reserved_kwargs

    class Tokenizer:
        def apply_chat_template(self, conversation, tools=None, new_option=False, **kwargs):
            pass
    assert {"new_option", "tokenize", "return_tensors", "chat_template"} <= reserved_kwargs(Tokenizer())


# ---- the flag and the key ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize", "/invocations"])
@pytest.mark.parametrize("where", ["field", "kwargs"])
def test_request_template_needs_the_flag(keyed, path, where):
    body = {"messages": MESSAGES, "max_tokens": 2}
    body.update({"chat_template": TEMPLATE} if where == "field" else
                {"chat_template_kwargs": {"chat_template": TEMPLATE}})
    assert "--trust-request-chat-template" in _error(keyed.post(path, json=body))["message"]


def test_request_template_is_rendered_with_the_flag(trusting):
    r = trusting.post("/tokenize", json={"messages": MESSAGES, "chat_template": TEMPLATE})
    assert r.status_code == 200, r.text
    assert get_tokenizer(EngineArgs.model).decode(r.json()["tokens"]) == "[Hi]"
    chat = trusting.post("/v1/chat/completions", json={"messages": MESSAGES, "chat_template": TEMPLATE,
                                                       "max_tokens": 1, "return_token_ids": True})
    assert chat.status_code == 200 and chat.json()["prompt_token_ids"] == r.json()["tokens"]


GUARDED = [("POST", "/tokenize", {"prompt": "Hi"}), ("POST", "/detokenize", {"tokens": [5]}),
           ("POST", "/invocations", {"prompt": "Hi", "max_tokens": 1}), ("GET", "/docs", None),
           ("GET", "/openapi.json", None)]


def test_every_route_but_the_probes_needs_the_key(servers):
    url = servers[0].url
    for method, path, body in GUARDED:
        assert httpx.request(method, url + path, json=body, timeout=60).status_code == 401, path
        assert httpx.request(method, url + path, json=body, headers=AUTH, timeout=60).status_code == 200, path
    for path in ("/health", "/ping", "/version", "/metrics"):
        assert httpx.get(url + path, timeout=60).status_code == 200, path


# ---- chat_template_kwargs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value", [
    ("return_tensors", "pt"), ("tokenize", False), ("return_dict", False), ("add_generation_prompt", False),
    ("continue_final_message", True), ("tools", []), ("documents", []), ("padding", "max_length"),
    ("truncation", True), ("max_length", 2)])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_apply_chat_template_arguments_are_refused(keyed, path, key, value):
    r = keyed.post(path, json={"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {key: value}})
    error = _error(r)
    assert error["param"] == f"chat_template_kwargs.{key}" and "not allowed" in error["message"]


# ---- bounded renders ----------------------------------------------------------------------------------------------

def test_looping_template_is_stopped_while_other_requests_are_answered(trusting):
    looped: dict = {}

    def loop() -> None:
        start = time.monotonic()
        looped["response"] = trusting.post("/v1/chat/completions", json={"messages": MESSAGES,
                                                                          "chat_template": LOOP})
        looped["s"], looped["at"] = time.monotonic() - start, time.monotonic()
    thread = threading.Thread(target=loop)
    thread.start()
    time.sleep(0.3)
    normal = trusting.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})
    answered_at = time.monotonic()
    thread.join()
    assert normal.status_code == 200 and answered_at < looped["at"]
    error = _error(looped["response"])
    assert f"did not finish within {TIMEOUT_S} s" in error["message"] and error["param"] == "chat_template"
    assert looped["s"] < TIMEOUT_S + 5
    # The stopped renderer was replaced: the next renders (two at once) are served.
    with ThreadPoolExecutor(2) as pool:
        again = list(pool.map(lambda _: trusting.post("/tokenize", json={"messages": MESSAGES}), range(2)))
    assert [r.status_code for r in again] == [200, 200]


@pytest.mark.parametrize("template, fragment", [(HUGE, "over the limit of"), (GREEDY, "more memory than")],
                         ids=["huge-output", "huge-string"])
def test_huge_templates_get_400(trusting, template, fragment):
    start = time.monotonic()
    error = _error(trusting.post("/tokenize", json={"messages": MESSAGES, "chat_template": template}))
    assert fragment in error["message"] and time.monotonic() - start < TIMEOUT_S
    assert trusting.post("/tokenize", json={"messages": MESSAGES}).status_code == 200


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found.update(kids)
        todo.extend(kids)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_with_a_looping_render_in_flight_stops_everything(servers, trusting):
    server = servers[1]
    thread = threading.Thread(target=lambda: trusting.post("/v1/chat/completions", json={
        "messages": MESSAGES, "chat_template": LOOP}), daemon=True)
    thread.start()
    time.sleep(0.5)
    processes = _descendants(server.proc.pid)
    assert len(processes) >= 3  # the engine core, the forkserver, the renderers
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(30)
    exit_s = time.monotonic() - start
    assert exit_s < TIMEOUT_S + 7, f"exit took {exit_s:.1f} s"
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in processes if _alive(p)]
    assert "Traceback" not in server.stderr(), server.stderr()[-3000:]
