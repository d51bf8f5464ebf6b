"""The prefix cache's hashes and its KDA state snapshots (the MLA blocks' side is block_pool.py).

A KDA layer's recurrent state summarises every token before it and cannot be cut back, so a cached prefix of
L tokens is usable only with a copy of the state taken at exactly L: a snapshot. Snapshots live in extra slots
of the KDA state pools, keyed by the chain hash of the block that ends at L, so a hit is the deepest block of
the request's chain that has a snapshot (and, with MLA layers, every block before it cached). Where snapshots
are taken and what they cost: docs/prefix_caching.md.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


def hash_blocks(tokens: np.ndarray, block_size: int, hashes: list[bytes], num_blocks: int) -> list[bytes]:
    """Extends `hashes` (the chain of `tokens`' full blocks so far) to `num_blocks` blocks: each block's hash
    covers its tokens and the previous block's hash, so equal hashes mean equal prefixes."""
    prev = hashes[-1] if hashes else b""
    for i in range(len(hashes), num_blocks):
        prev = hashlib.blake2b(prev + tokens[i * block_size:(i + 1) * block_size].tobytes(), digest_size=16).digest()
        hashes.append(prev)
    return hashes


@dataclass(slots=True)
class CacheHit:
    """What a request finds: `num_tokens` cached (a block boundary), the blocks holding them, the snapshot
    slot holding the KDA state there (None without KDA layers), and `num_cached_blocks`: the longest run of
    cached blocks, which may reach past the deepest snapshot."""
    num_tokens: int = 0
    blocks: list[int] = field(default_factory=list)
    snapshot: int | None = None
    num_cached_blocks: int = 0


class SnapshotPool:
    """Snapshot slots: free, pending (a step copies a state there; the host learns afterwards whether the state
    was the one wanted) or cached under a block hash, in LRU order. Reserving a slot evicts the least recently
    used cached snapshot when none is free; pending slots are never evicted."""

    def __init__(self, slots: list[int]) -> None:
        self.slots = list(slots)
        self.free: list[int] = self.slots[::-1]
        self.entries: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot, LRU first
        self.pending: set[int] = set()
        self.num_evicted = 0  # cached snapshots whose slot was taken for another

    def __len__(self) -> int:
        return len(self.slots)

    def get(self, key: bytes) -> int | None:
        slot = self.entries.get(key)
        if slot is not None:
            self.entries.move_to_end(key)
        return slot

    def reserve(self) -> int | None:
        if self.free:
            slot = self.free.pop()
        elif self.entries:
            _, slot = self.entries.popitem(last=False)
            self.num_evicted += 1
        else:
            return None
        self.pending.add(slot)
        return slot

    def commit(self, slot: int, key: bytes) -> None:
        self.pending.remove(slot)
        if key in self.entries:  # another request's snapshot of the same prefix came first
            self.free.append(slot)
        else:
            self.entries[key] = slot

    def discard(self, slot: int) -> None:
        self.pending.remove(slot)
        self.free.append(slot)

    def drop(self, key: bytes) -> None:
        """Its block was evicted: the snapshot can no longer be reached."""
        slot = self.entries.pop(key, None)
        if slot is not None:
            self.free.append(slot)

    def demote(self, key: bytes) -> None:
        """First to be evicted (a request moved its decode snapshot past this one)."""
        if key in self.entries:
            self.entries.move_to_end(key, last=False)

    def reset(self) -> None:
        self.free.extend(self.entries.values())
        self.entries.clear()

    def assert_all_free(self) -> None:
        assert not self.pending, f"snapshot slots {sorted(self.pending)} still pending"
        assert sorted(self.free + list(self.entries.values())) == sorted(self.slots), "snapshot pool lost slots"
