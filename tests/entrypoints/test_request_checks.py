"""The request-body and prompt checks that run on every request, on the server's event loop: their answers
(their cost for long token-id prompts is measured in the commit that made them set-based, not timed here)."""
from __future__ import annotations

import pytest

from vllm.entrypoints.openai.protocol import CompletionRequest
from vllm.entrypoints.openai.request_body import _lone_surrogate
from vllm.inputs.validation import prompt_problem


def test_lone_surrogates_are_found_by_path_among_ids_and_nested_values():
    assert _lone_surrogate({"prompt": list(range(1000)), "n": 1, "stop": None, "t": 0.5, "b": True}) is None
    assert _lone_surrogate({"messages": [{"content": [1, 2.5, None, "ok", "a\ud800"]}]}) == "messages[0].content[4]"
    assert _lone_surrogate({"prompt": [[1, 2], [3, "\udfff"]]}) == "prompt[1][1]"
    assert _lone_surrogate({"k\ud800": 1}) == ""


def test_prompt_shapes_and_id_checks():
    assert CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, 3]}).prompt == [[1, 2, 3]]
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[1], [2, 3]]}).prompt == [[1], [2, 3]]
    for bad in ([1, True], [1, "a"], [[1], "a"], []):
        with pytest.raises(ValueError):
            CompletionRequest.model_validate({"model": "m", "prompt": bad})
    assert prompt_problem([0, 9], 10) is None
    assert "out of vocabulary" in prompt_problem([3, 10, -1], 10) and "[10, -1]" in prompt_problem([3, 10, -1], 10)
    assert "must be integers, got [True, 1.0]" in prompt_problem([1, True, 1.0], 10)
