"""RequestOutputs through the engine core's pipe format: every field survives (set to something other than its
default, so a field the packer forgot, or a reordered one, fails), prompts are left for the receiver."""
from __future__ import annotations

import dataclasses
import pickle

from vllm.engine.serial_utils import pack_outputs, unpack_outputs
from vllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def full_output() -> RequestOutput:
    metrics = RequestMetrics(*[i + 0.5 for i in range(len(dataclasses.fields(RequestMetrics)) - 1)], [3, 1])
    completions = [CompletionOutput(0, "ab", [5, 6], -1.5, [{5: Logprob(-0.1, 1, "a"), 9: Logprob(-2.0, 2, "z")},
                                                            {6: Logprob(-0.2, 1, "b")}], "stop", 6),
                   CompletionOutput(1, "c", [7], None, None, None, None)]
    fields = {f.name for f in dataclasses.fields(RequestOutput)}
    out = RequestOutput("req-1", "the prompt", [1, 2, 3], [None, {2: Logprob(-3.0, 4, "x")}], completions, True,
                        metrics, num_cached_tokens=16, extra={"k": 1}, error="boom")
    unset = [f for f in fields if getattr(out, f) == getattr(RequestOutput("r", None, [], None, [], False), f)]
    assert not unset, f"set these fields in the test too: {unset}"
    return out


def test_every_field_survives_the_pipe_but_the_prompt():
    out = full_output()
    back, = unpack_outputs(pickle.loads(pickle.dumps(pack_outputs([out]))))
    assert (back.prompt, back.prompt_token_ids) == (None, [])
    back.prompt, back.prompt_token_ids = out.prompt, out.prompt_token_ids
    assert back == out


def test_no_metrics_and_no_outputs():
    out = RequestOutput("r", None, [], None, [], False)
    assert unpack_outputs(pack_outputs([out])) == [out]
