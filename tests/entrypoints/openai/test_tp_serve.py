"""`vllm serve -tp 2`: the openai client gets its answers from an engine over 2 ranks (the engine core process is
rank 0 and starts rank 1), and SIGTERM leaves no process behind."""
from __future__ import annotations

import signal
import time

import openai
from processes import children


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_serve_with_two_ranks_answers_and_leaves_no_process(start_server):
    server = start_server("-tp", "2", "--max-num-seqs", "8")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=16, temperature=0)
    assert r.usage.completion_tokens == 16
    full = r.choices[0].text
    # A stop string ends the request in the front end, which frees it in rank 0's core; the other rank frees it
    # in the same step (the call is broadcast), so the next requests still run on ranks that agree.
    stop = full[len(full) // 2:len(full) // 2 + 2]
    cut = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=16, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == full[:full.index(stop)]
    again = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=16, temperature=0,
                                      n=2)
    assert [c.text for c in again.choices] == [full, full]
    pids = [server.proc.pid]
    for _ in range(2):  # the server's engine core process, then its rank
        pids += [c for p in pids for c in children(p)]
    assert len(set(pids)) >= 3
    server.stop(signal.SIGTERM)
    deadline = time.monotonic() + 15
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if alive(p)], "a process of the server outlived it"
