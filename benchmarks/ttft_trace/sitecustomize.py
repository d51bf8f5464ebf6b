"""Loaded by every Python process that has this folder on PYTHONPATH, as trace_served_ttft.py starts `vllm serve`
(front end and its spawned engine core): with TTFT_TRACE=<dir> set, appends `monotonic_seconds event` lines to
<dir>/<pid>.log at each hop of a request. CLOCK_MONOTONIC is one clock for every process of the machine."""
import os
import sys
import time

if os.environ.get("TTFT_TRACE"):
    import builtins
    import multiprocessing.connection as mpc

    _log = open(os.path.join(os.environ["TTFT_TRACE"], f"{os.getpid()}.log"), "a", buffering=1)

    def event(name: str) -> None:
        _log.write(f"{time.monotonic():.6f} {name}\n")

    def _kind(obj) -> str:
        if not (isinstance(obj, tuple) and obj and isinstance(obj[0], str)):
            return "?"
        n = len(obj[1]) if len(obj) > 1 and isinstance(obj[1], list) else ""
        return f"{obj[0]} {n}".strip()

    _send, _recv = mpc.Connection.send, mpc.Connection.recv

    def send(self, obj):
        event(f"send {_kind(obj)}")
        return _send(self, obj)

    def recv(self):
        obj = _recv(self)
        event(f"recv {_kind(obj)}")
        return obj

    mpc.Connection.send, mpc.Connection.recv = send, recv

    def _wrap(cls, name: str, label: str):
        inner = getattr(cls, name)

        def timed(*args, **kwargs):
            event(f"{label}_begin")
            out = inner(*args, **kwargs)
            event(f"{label}_end")
            return out
        setattr(cls, name, timed)

    def _wrap_async(cls, name: str, label: str):
        inner = getattr(cls, name)

        async def timed(*args, **kwargs):
            event(label)
            return await inner(*args, **kwargs)
        setattr(cls, name, timed)

    # Patched as each module finishes importing (its last class defined), then the import hook is removed.
    _pending = {"vllm.engine.core": "portable", "vllm.engine.core_client": "MPClient",
                "vllm.entrypoints.openai.serving_completion": "_Run"}
    _import = builtins.__import__

    def _patch(module: str, m) -> None:
        if module == "vllm.engine.core":
            inner = m.EngineCore.step

            def step(self):
                # step_end <outputs> <rows> <tokens> <prefill rows> <prefill tokens>: the step launched last
                event("step_begin")
                out = inner(self)
                rows = getattr(self.engine.last_scheduled, "scheduled", None) or []
                pre = [r.num_tokens for r in rows if r.is_prefilling]
                event(f"step_end {len(out[0])} {len(rows)} {sum(r.num_tokens for r in rows)} {len(pre)} {sum(pre)}")
                return out
            m.EngineCore.step = step
        elif module == "vllm.engine.core_client":
            _wrap(m.MPClient, "add_request", "add_request")
            _wrap(m.MPClient, "_deliver", "deliver")
        else:
            _wrap_async(m.OpenAIServingCompletion, "create", "create")
            sse = m.sse

            def traced_sse(obj):
                event("sse")
                return sse(obj)
            m.sse = traced_sse

    def _hook(name, *args, **kwargs):
        module = _import(name, *args, **kwargs)
        for mod, last in list(_pending.items()):
            m = sys.modules.get(mod)
            if m is not None and hasattr(m, last):
                del _pending[mod]
                _patch(mod, m)
        if not _pending:
            builtins.__import__ = _import
        return module

    builtins.__import__ = _hook
