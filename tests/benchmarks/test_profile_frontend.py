"""benchmarks/profile_frontend.py: py-spy's collapsed stacks read into busy shares by function."""
from __future__ import annotations

import benchmark_scripts

prof = benchmark_scripts.load("profile_frontend")


def test_idle_samples_are_left_out_and_lines_of_a_function_add_up():
    raw = ["run (a.py:1);select (s.py:9);EpollSelector.select (selectors.py:468) 60",
           "run (a.py:1);stream (c.py:10);write (t.py:5) 25",
           "run (a.py:1);stream (c.py:12) 10",
           "run (a.py:1);stream (c.py:10);stream (c.py:30) 5",  # recursion counts once per stack
           "", "garbage line"]
    got = prof.summarize(raw)
    assert got["samples"] == 100 and got["busy_share"] == 0.4
    assert dict(got["own"]) == {"write (t.py)": 62.5, "stream (c.py)": 37.5}
    assert dict(got["inclusive"]) == {"run (a.py)": 100.0, "stream (c.py)": 100.0, "write (t.py)": 62.5}
    assert prof.summarize([]) == {"samples": 0, "busy_share": 0.0, "own": [], "inclusive": []}
