"""Stored /v1/responses: the memory store keeps the last `limit`; the shared store (several API server processes)
gives every process what any wrote, keeps about the last `limit`, and treats an id the server could not have made
(a path, another prefix) as unknown."""
from __future__ import annotations

import asyncio
import uuid

from vllm.entrypoints.openai import response_store
from vllm.entrypoints.openai.response_store import MemoryResponseStore, SharedResponseStore


def rid() -> str:
    return f"resp_{uuid.uuid4().hex}"


def test_memory_store_keeps_the_last_entries():
    async def main():
        store = MemoryResponseStore(limit=3)
        ids = [rid() for _ in range(5)]
        for i, r in enumerate(ids):
            await store.put(r, ({"id": r, "n": i}, [{"role": "user", "content": str(i)}]))
        assert [await store.get(r) is None for r in ids] == [True, True, False, False, False]
        assert await store.get(ids[4]) == ({"id": ids[4], "n": 4}, [{"role": "user", "content": "4"}])
    asyncio.run(main())


def test_shared_store_is_seen_by_every_process_and_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(response_store, "EVICT_EVERY", 2)

    async def main():
        a, b = SharedResponseStore(tmp_path, limit=4), SharedResponseStore(tmp_path, limit=4)
        first = rid()
        entry = ({"id": first, "output": [{"type": "message"}]}, [{"role": "user", "content": "hi"}])
        await a.put(first, entry)
        assert await b.get(first) == entry  # another process's store reads it
        assert await b.get(rid()) is None
        for bad in ["../x", "resp_../../etc/passwd", "msg_" + "0" * 32, ""]:
            assert await b.get(bad) is None
        for i in range(9):
            await (a if i % 2 else b).put(rid(), ({"n": i}, []))
        left = sorted(p.name for p in tmp_path.iterdir())
        assert len(left) <= 4 + 2 * 2 and all(name.endswith(".json") for name in left)  # no temporary files
        assert await a.get(first) is None  # the oldest went first
    asyncio.run(main())
