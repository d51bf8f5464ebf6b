"""Process helpers for the tests that check no process outlives the engine."""
from __future__ import annotations

import subprocess


def children(pid: int) -> list[int]:
    """The pids of `pid`'s direct children."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]
