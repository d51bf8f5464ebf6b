"""Environment variables the engine reads, under upstream's names."""
from __future__ import annotations

import os

# "0" keeps the engine core in the server's own process (upstream's switch of the same name); anything else, or
# unset, runs it in a process of its own.
ENABLE_MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def enable_multiprocessing() -> bool:
    return os.environ.get(ENABLE_MULTIPROCESSING_ENV, "1").strip() != "0"
