"""A warning for every Triton kernel compiled after start-up.

A compile stalls the step that needs it for 0.1-1 s (an autotuned kernel compiles once per config it tries),
and while serving, every request in flight waits through it. Start-up compiles what it runs: the profile run,
the graph captures, the first steps. A variant first met later (a block size picked from a chunk length not
seen yet, a new autotuner key, Triton's specialisation of an integer argument that became a multiple of 16)
is named here with its constexprs, so it can be warmed at start-up or pinned; a served run whose ITL or TTFT
has one-second outliers is the symptom (benchmarks/bench_serve_sweep.py).

Triton calls `knobs.runtime.jit_cache_hook` before a compile and `jit_post_compile_hook` after it, for every
kernel of the process (fla-core's too). Hooks that were set before are kept and called first.
"""
from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

# Loading a kernel already in Triton's disk cache also passes through the hooks, in a few ms.
COMPILE_WARNING_S = 0.05


class CompileWatch:
    def __init__(self) -> None:
        self.num_compiles = 0  # compiles (and disk-cache loads) since install()
        self.compile_s = 0.0
        self._started: list[float] = []  # compiles do not nest: before/after pairs come in order
        self._knobs = None
        self._previous = (None, None)

    def install(self) -> None:
        """Starts watching; a no-op without Triton or when already installed."""
        try:
            from triton import knobs
        except ImportError:  # a CPU install without triton (or one older than its knobs): nothing to watch
            return
        if self._knobs is not None or not hasattr(knobs.runtime, "jit_post_compile_hook"):
            return
        self._knobs = knobs.runtime
        self._previous = (self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook)
        self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = self.before_compile, self.after_compile

    def uninstall(self) -> None:
        if self._knobs is not None:
            self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = self._previous
            self._knobs = None

    def before_compile(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):
        """Triton's JITHook before a compile. It must not return a truthy value: that skips the compile."""
        self._started.append(time.perf_counter())
        if self._previous[0] is not None:
            self._previous[0](key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                              already_compiled=already_compiled)
        return None

    def after_compile(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):
        now = time.perf_counter()
        seconds = now - (self._started.pop() if self._started else now)
        self.num_compiles += 1
        self.compile_s += seconds
        if seconds >= COMPILE_WARNING_S:
            logger.warning("Triton compiled %s after start-up in %.2f s: the step that needed it stalled that long; "
                           "constexprs %s", repr, seconds, compile.get("constants") if isinstance(compile, dict)
                           else None)
        if self._previous[1] is not None:
            self._previous[1](key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                              already_compiled=already_compiled)
        return None


# One per process: Triton's hooks are process-wide.
COMPILE_WATCH = CompileWatch()
