"""benchmarks/fuzz_server.py's bad requests against a real server with an API key: every one gets a 4xx with an
OpenAI-shaped error (or is accepted where upstream accepts it), good streams running alongside keep their exact
greedy text, the server stays healthy and logs no traceback."""
from __future__ import annotations

import asyncio

import benchmark_scripts
import pytest


@pytest.fixture(scope="module")
def fuzz():
    return benchmark_scripts.load("fuzz_server")


def test_every_bad_request_is_a_4xx_and_good_streams_are_untouched(start_server, fuzz):
    server = start_server("--api-key", fuzz.KEY)
    report = asyncio.run(fuzz.fuzz(server.url, fuzz.KEY, concurrency=8, streams=4))
    assert report["kinds"] > 300
    assert not report["problems"], "\n".join(report["problems"])
    assert all(400 <= s < 500 or s == 200 for s in report["statuses"]), report["statuses"]
    assert "Traceback" not in server.stderr()
