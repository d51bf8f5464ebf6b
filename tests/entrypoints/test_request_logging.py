"""`vllm serve` logs requests only with --enable-log-requests (upstream's default): the prompt, cut at
--max-log-len, and the sampling parameters; --disable-log-requests, upstream's older spelling, wins."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from vllm.entrypoints.cli.main import build_parser
from vllm.entrypoints.cli.serve import logs_requests
from vllm.entrypoints.openai.serving_engine import OpenAIServing, ServerSettings
from vllm.sampling_params import SamplingParams


@pytest.mark.parametrize("flags,expected", [([], False), (["--enable-log-requests"], True),
                                            (["--disable-log-requests"], False),
                                            (["--enable-log-requests", "--disable-log-requests"], False)])
def test_flags(flags, expected):
    assert logs_requests(build_parser().parse_args(["serve", *flags])) is expected


@pytest.mark.parametrize("log_requests,max_log_len", [(False, None), (True, None), (True, 3)])
def test_log_request_writes_the_prompt_only_when_asked(caplog, log_requests, max_log_len):
    settings = ServerSettings(["m"], max_log_len=max_log_len, log_requests=log_requests)
    with caplog.at_level(logging.INFO, logger="vllm.entrypoints.openai"):
        OpenAIServing.log_request(SimpleNamespace(settings=settings), "cmpl-1", [11, 12, 13, 14, 15],
                                  SamplingParams(max_tokens=7))
    lines = [r.getMessage() for r in caplog.records if "Received request" in r.getMessage()]
    if not log_requests:
        assert lines == []
    else:
        (line,) = lines
        shown = [11, 12, 13, 14, 15][:max_log_len]
        assert f"Received request cmpl-1: prompt: {shown!r}," in line and "max_tokens=7" in line


def test_settings_default_is_off():
    assert ServerSettings(["m"]).log_requests is False
