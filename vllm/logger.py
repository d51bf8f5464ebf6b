"""The package's log format, set up once per process: by the CLI in the front end, and again in the engine core
process (a spawned interpreter starts with logging unconfigured and would drop its INFO lines)."""
from __future__ import annotations

import logging

LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


def init_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format=LOG_FORMAT)
