"""BlockPool: the free list of MLA latent-cache blocks."""
from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free_blocks), "caller checks num_free first"
        return [self.free_blocks.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self.free_blocks.extend(blocks)
