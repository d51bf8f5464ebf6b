"""KVCacheManager: MLA latent blocks and KDA recurrent-state slots per request.

Blocks grow with a request's length; a KDA state slot is held for the request's whole life. Everything is
returned on finish, abort and preemption; `assert_all_free` is the invariant tests check after each run.
"""
from __future__ import annotations

from vllm.core.block_pool import BlockPool
from vllm.core.request import Request


# Slot 0 of every state pool belongs to nobody: padding rows point at it, and FlashInfer's KDA kernels read
# slot 0 as "no state". Requests get slots 1..num_state_slots-1.
NULL_STATE_SLOT = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int, needs_blocks: bool,
                 needs_slots: bool) -> None:
        self.block_size = block_size
        self.needs_blocks, self.needs_slots = needs_blocks, needs_slots
        self.block_pool = BlockPool(num_blocks)
        self.num_state_slots = num_state_slots
        self.free_slots: list[int] = list(range(NULL_STATE_SLOT + 1, num_state_slots))[::-1]
        self.req_blocks: dict[str, list[int]] = {}
        self.req_slot: dict[str, int] = {}

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        if not self.needs_blocks:
            return 0
        total = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(self.req_blocks.get(request.request_id, ())))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Reserve cache room for `num_new_tokens` more tokens (and a state slot); False if it does not fit."""
        rid = request.request_id
        need_slot = self.needs_slots and rid not in self.req_slot
        if need_slot and not self.free_slots:
            return False
        n = self.blocks_needed(request, num_new_tokens)
        if n > self.block_pool.num_free:
            return False
        if n:
            self.req_blocks.setdefault(rid, []).extend(self.block_pool.allocate(n))
        if need_slot:
            self.req_slot[rid] = self.free_slots.pop()
        return True

    def free(self, request: Request) -> None:
        self.block_pool.free(self.req_blocks.pop(request.request_id, []))
        slot = self.req_slot.pop(request.request_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def block_ids(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def state_slot(self, request_id: str) -> int:
        return self.req_slot.get(request_id, NULL_STATE_SLOT)

    @property
    def usage(self) -> tuple[float, float]:
        """Fraction of blocks and of state slots in use."""
        pool = self.block_pool
        blocks = 1.0 - pool.num_free / pool.num_blocks if pool.num_blocks else 0.0
        usable = self.num_state_slots - 1
        slots = 1.0 - len(self.free_slots) / usable if usable > 0 else 0.0
        return blocks, slots

    def assert_all_free(self) -> None:
        assert not self.req_blocks and not self.req_slot, (
            f"leaked: blocks held by {sorted(self.req_blocks)}, slots held by {sorted(self.req_slot)}")
        assert self.block_pool.num_free == self.block_pool.num_blocks, "block pool is missing blocks"
        assert sorted(self.free_slots) == list(range(NULL_STATE_SLOT + 1, self.num_state_slots)), (
            "state slot pool is missing slots")
