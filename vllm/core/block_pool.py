"""BlockPool: the MLA latent-cache blocks, reference-counted, with the prefix cache's hashed blocks.

A block is held by the requests that reference it. With prefix caching a full block of known tokens is hashed
(prefix_cache.hash_blocks: each hash chained to the previous block's) and found by that hash; when no request
holds it any more it stays hashed in the free list, in LRU order, until it is allocated again. Free blocks with
no hash are handed out first.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable


class BlockPool:
    def __init__(self, num_blocks: int, on_evict: Callable[[bytes], None] | None = None) -> None:
        self.num_blocks = num_blocks
        # Allocation takes from the front: unhashed blocks first, then hashed ones, least recently freed first.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.ref_cnt = [0] * num_blocks
        self.cached: dict[bytes, int] = {}  # block hash -> block
        self.block_hash: dict[int, bytes] = {}
        self.on_evict = on_evict  # a cached block's hash is dropped (the snapshots keyed by it go with it)
        self.num_evicted = 0  # cached blocks allocated for other tokens

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free_blocks), "caller checks num_free first"
        blocks = []
        for _ in range(n):
            block, _ = self.free_blocks.popitem(last=False)
            self._drop_hash(block)
            self.ref_cnt[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[int]) -> None:
        """One more reference to each of these cached blocks (a request reuses them)."""
        for block in blocks:
            if self.ref_cnt[block] == 0:
                del self.free_blocks[block]
            self.ref_cnt[block] += 1

    def free(self, blocks: list[int]) -> None:
        """One reference less to each block. Released hashed blocks join the LRU end, the deepest of a chain
        first (so it is evicted before the blocks it extends); released unhashed ones go to the front."""
        for block in reversed(blocks):
            self.ref_cnt[block] -= 1
            assert self.ref_cnt[block] >= 0, f"block {block} freed more often than allocated"
            if self.ref_cnt[block] == 0:
                self.free_blocks[block] = None
                if block not in self.block_hash:
                    self.free_blocks.move_to_end(block, last=False)

    def cache(self, block: int, block_hash: bytes) -> None:
        """Registers a full block under its chain hash (a block already cached under it keeps it)."""
        if block_hash not in self.cached and block not in self.block_hash:
            self.cached[block_hash] = block
            self.block_hash[block] = block_hash

    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes`."""
        blocks = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def reset(self) -> None:
        """Forgets every hash (blocks in use stay with their requests, uncached)."""
        for block_hash in list(self.cached):
            if self.on_evict is not None:
                self.on_evict(block_hash)
        self.cached.clear()
        self.block_hash.clear()

    def _drop_hash(self, block: int) -> None:
        block_hash = self.block_hash.pop(block, None)
        if block_hash is not None:
            self.num_evicted += 1
            del self.cached[block_hash]
            if self.on_evict is not None:
                self.on_evict(block_hash)
