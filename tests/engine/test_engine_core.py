"""EngineCore's slow-step warning: a step far slower than the steps before it is logged with its shape."""
from __future__ import annotations

import logging
from types import SimpleNamespace

from vllm import SamplingParams
from vllm.engine import core as core_module
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.core import EngineCore
from vllm.engine.llm_engine import LLMEngine
from vllm.worker.model_runner import ModelRunner


def test_a_stalled_step_is_logged_with_its_shape(monkeypatch, caplog):
    core = EngineCore(LLMEngine.from_engine_args(EngineArgs(max_model_len=128, dtype="float32")))
    real = ModelRunner.execute_model
    # The core's step clock is a fake that each forward advances: 10 ms a step, 150 ms for a stalled one (as
    # a kernel compiled mid-run would), so a loaded CI machine's real step times cannot flag a step.
    clock = {"now": 0.0, "stall": False}

    def execute(self, *args, **kwargs):
        clock["now"] += 0.15 if clock["stall"] else 0.01
        return real(self, *args, **kwargs)
    monkeypatch.setattr(ModelRunner, "execute_model", execute)
    monkeypatch.setattr(core_module, "time", SimpleNamespace(perf_counter=lambda: clock["now"]))
    monkeypatch.setattr(core_module, "SLOW_STEP_S", 0.1)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i in range(3):
        assert core.add_request(f"r{i}", [5 + i] * (7 + i), params) is None
    with caplog.at_level(logging.WARNING, logger="vllm.engine.core"):
        for _ in range(3):
            core.step()
        assert not [r for r in caplog.records if "engine step took" in r.getMessage()]
        clock["stall"] = True
        core.step()
    [record] = [r for r in caplog.records if "engine step took" in r.getMessage()]
    assert "3 rows, 3 tokens" in record.getMessage(), record.getMessage()
