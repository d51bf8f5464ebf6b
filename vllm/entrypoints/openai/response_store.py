"""Where /v1/responses keeps stored responses (`store`, the default) for GET and `previous_response_id`: in the
server's memory, or, with several API server processes (`--api-server-count`), in a directory they share, so that
a conversation continues whichever process the next request reaches.

Both keep about the last MAX_STORED responses: each entry is (response body, conversation so far).
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections import OrderedDict
from pathlib import Path

MAX_STORED = 1024
_ID = re.compile(r"resp_[0-9a-f]{32}")  # what the server makes; anything else a client sends is simply not stored
EVICT_EVERY = 64  # shared store: new entries between two sweeps for the oldest


class MemoryResponseStore:
    def __init__(self, limit: int = MAX_STORED) -> None:
        self.limit = limit
        self.entries: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    async def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        return self.entries.get(response_id)

    async def put(self, response_id: str, entry: tuple[dict, list[dict]]) -> None:
        self.entries[response_id] = entry
        while len(self.entries) > self.limit:
            self.entries.popitem(last=False)


class SharedResponseStore:
    """A JSON file per response in `directory` (the launcher makes and removes it), written whole then renamed, so
    a reader never sees half of one; file I/O runs in a worker thread (a long agent conversation is megabytes).
    Each process sweeps the oldest files beyond the limit every EVICT_EVERY entries it writes, so the directory
    holds at most limit + EVICT_EVERY x processes."""

    def __init__(self, directory: str | Path, limit: int = MAX_STORED) -> None:
        self.dir, self.limit, self.written = Path(directory), limit, 0

    async def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        if not _ID.fullmatch(response_id):
            return None
        try:
            body, conversation = json.loads(await asyncio.to_thread((self.dir / f"{response_id}.json").read_text))
        except FileNotFoundError:
            return None
        return body, conversation

    async def put(self, response_id: str, entry: tuple[dict, list[dict]]) -> None:
        await asyncio.to_thread(self._write, response_id, json.dumps(entry))
        self.written += 1
        if self.written % EVICT_EVERY == 0:
            await asyncio.to_thread(self._evict)

    def _write(self, response_id: str, text: str) -> None:
        tmp = self.dir / f".{response_id}.{os.getpid()}.tmp"
        tmp.write_text(text)
        now = time.time_ns()  # exact, where the file system's own stamp may be a clock tick coarse: eviction's order
        os.utime(tmp, ns=(now, now))
        os.replace(tmp, self.dir / f"{response_id}.json")

    def _evict(self) -> None:
        files = []
        for f in os.scandir(self.dir):
            if f.name.endswith(".json"):
                try:
                    files.append((f.stat().st_mtime_ns, f.path))
                except FileNotFoundError:  # another process swept it meanwhile
                    continue
        files.sort()
        for _, path in files[:max(0, len(files) - self.limit)]:
            Path(path).unlink(missing_ok=True)


def response_store(directory: str | None) -> MemoryResponseStore | SharedResponseStore:
    return MemoryResponseStore() if directory is None else SharedResponseStore(directory)
