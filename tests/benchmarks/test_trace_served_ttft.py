"""benchmarks/trace_served_ttft.py: the hops of a request read from the two processes' event stamps."""
from __future__ import annotations

import benchmark_scripts
import pytest

trace = benchmark_scripts.load("trace_served_ttft")


def test_hops_follow_one_request_through_front_end_and_core(tmp_path):
    front, core = "100", "200"
    stamps = {front: [(10.0005, "create"), (10.0010, "add_request_begin"), (10.0012, "send add"),
                      (10.0101, "recv outputs 0"), (10.0150, "recv outputs 1"), (10.0160, "sse")],
              core: [(9.5, "step_end 3"),  # an earlier request's: outside the window
                     (10.0020, "recv add"), (10.0025, "step_begin"), (10.0090, "step_end 0"),
                     (10.0100, "send outputs 0"), (10.0101, "step_begin"), (10.0140, "step_end 1"),
                     (10.0141, "send outputs 1")]}
    for pid, lines in stamps.items():
        (tmp_path / f"{pid}.log").write_text("".join(f"{t:.6f} {n}\n" for t, n in lines))
    events = trace.read_events(tmp_path)
    h = trace.hops(10.0, 10.0170, events)
    # The prefill step returned nothing (async scheduling): the first token came from the step after it.
    assert h["steps"] == 2
    want = {"http_in": 0.5, "to_core": 1.5, "core_wait": 0.5, "core_steps": 11.5, "from_core": 1.0, "build": 1.0,
            "http_out": 1.0, "ttft": 17.0}
    assert h == pytest.approx({**want, "steps": 2}, abs=1e-6)
    assert sum(h[k] for k in trace.HOPS) == pytest.approx(h["ttft"])
    assert trace.hops(10.0, 10.0120, events) is None  # the first token was not in that window
