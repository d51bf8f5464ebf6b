"""CompileWatch against Triton's own hook protocol (CPU: no kernel compiles here, the hooks are called as
Triton calls them)."""
from __future__ import annotations

import inspect
import logging

import pytest

triton = pytest.importorskip("triton")
from triton import knobs  # noqa: E402

from vllm.worker import compile_watch  # noqa: E402
from vllm.worker.compile_watch import CompileWatch  # noqa: E402


def hook_kwargs(key: str = "k1") -> dict:
    """Every keyword of Triton's JITHook protocol, as JITFunction._call_hook passes them."""
    names = [p for p in inspect.signature(knobs.JITHook.__call__).parameters if p != "self"]
    values = {"key": key, "repr": "_my_kernel[num_warps=4](x_ptr: *fp32, n: i32)", "fn": None,
              "compile": {"key": key, "constants": {"BLOCK": 64}}, "is_manual_warmup": False,
              "already_compiled": False}
    assert set(names) == set(values), f"Triton's hook protocol changed: {names}"
    return values


@pytest.fixture
def clean_knobs():
    saved = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None
    yield
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = saved


def test_a_slow_compile_is_named_and_counted(clean_knobs, monkeypatch, caplog):
    watch = CompileWatch()
    watch.install()
    assert knobs.runtime.jit_cache_hook == watch.before_compile
    clock = iter([10.0, 10.4, 20.0, 20.001])
    monkeypatch.setattr(compile_watch.time, "perf_counter", lambda: next(clock))
    with caplog.at_level(logging.WARNING, logger=compile_watch.__name__):
        assert not knobs.runtime.jit_cache_hook(**hook_kwargs()), "a truthy return would skip the compile"
        knobs.runtime.jit_post_compile_hook(**hook_kwargs())
        knobs.runtime.jit_cache_hook(**hook_kwargs("k2"))  # a disk-cache load: 1 ms, counted, not reported
        knobs.runtime.jit_post_compile_hook(**hook_kwargs("k2"))
    assert watch.num_compiles == 2 and watch.compile_s == pytest.approx(0.401)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "_my_kernel" in warnings[0] and "0.40 s" in warnings[0] and "BLOCK" in warnings[0]
    watch.uninstall()
    assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook is None


def test_hooks_set_before_are_kept(clean_knobs):
    seen = []
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(("before", kw["key"]))
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(("after", kw["key"]))
    watch = CompileWatch()
    watch.install()
    watch.install()  # twice: still one layer
    knobs.runtime.jit_cache_hook(**hook_kwargs())
    knobs.runtime.jit_post_compile_hook(**hook_kwargs())
    assert seen == [("before", "k1"), ("after", "k1")] and watch.num_compiles == 1
    watch.uninstall()
    knobs.runtime.jit_cache_hook(**hook_kwargs("k3"))
    assert seen[-1] == ("before", "k3")
