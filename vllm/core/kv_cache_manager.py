"""KVCacheManager: MLA latent blocks and KDA recurrent-state slots per request.

Blocks grow with a request's length; KDA state slots are held for the request's whole life: one, or with
speculative decoding 1 + num_speculative_tokens checkpoint slots (the state after each verified token goes to
its own column, so a rejected draft leaves nothing to undo). Everything is returned on finish, abort and
preemption; `assert_all_free` is the invariant tests check after each run.
"""
from __future__ import annotations

from vllm.core.block_pool import BlockPool
from vllm.core.request import Request


# Slot 0 of every state pool belongs to nobody: padding rows point at it, and FlashInfer's KDA kernels read
# slot 0 as "no state". Requests get slots 1..num_state_slots-1.
NULL_STATE_SLOT = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int, needs_blocks: bool,
                 needs_slots: bool, slots_per_request: int = 1) -> None:
        self.block_size = block_size
        self.needs_blocks, self.needs_slots = needs_blocks, needs_slots
        self.slots_per_request = slots_per_request
        self.block_pool = BlockPool(num_blocks)
        self.num_state_slots = num_state_slots
        self.free_slots: list[int] = list(range(NULL_STATE_SLOT + 1, num_state_slots))[::-1]
        self.req_blocks: dict[str, list[int]] = {}
        self.req_slots: dict[str, list[int]] = {}
        # A fresh number each time a request's block list starts over (first allocation, or after a free): its
        # (request id, number) names one append-only list, which lets the input batch write only new entries.
        self.block_list_ids: dict[str, int] = {}
        self._next_list_id = 0

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        if not self.needs_blocks:
            return 0
        total = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(self.req_blocks.get(request.request_id, ())))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Reserve cache room for `num_new_tokens` more tokens (and state slots); False if it does not fit."""
        rid = request.request_id
        need_slot = self.needs_slots and rid not in self.req_slots
        if need_slot and len(self.free_slots) < self.slots_per_request:
            return False
        n = self.blocks_needed(request, num_new_tokens)
        if n > self.block_pool.num_free:
            return False
        if n:
            if rid not in self.req_blocks:
                self._next_list_id += 1
                self.block_list_ids[rid] = self._next_list_id
            self.req_blocks.setdefault(rid, []).extend(self.block_pool.allocate(n))
        if need_slot:
            self.req_slots[rid] = [self.free_slots.pop() for _ in range(self.slots_per_request)]
        return True

    def free(self, request: Request) -> None:
        self.block_pool.free(self.req_blocks.pop(request.request_id, []))
        self.block_list_ids.pop(request.request_id, None)
        self.free_slots.extend(self.req_slots.pop(request.request_id, []))

    def block_ids(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def block_list_id(self, request_id: str) -> int:
        """Which block list the request holds now (0: none); its entries only ever grow at the end."""
        return self.block_list_ids.get(request_id, 0)

    def state_slots(self, request_id: str) -> list[int]:
        """The request's checkpoint slots (column 0 first), or the null slot for each column if it has none."""
        return self.req_slots.get(request_id) or [NULL_STATE_SLOT] * self.slots_per_request

    @property
    def usage(self) -> tuple[float, float]:
        """Fraction of blocks and of state slots in use."""
        pool = self.block_pool
        blocks = 1.0 - pool.num_free / pool.num_blocks if pool.num_blocks else 0.0
        usable = self.num_state_slots - 1
        slots = 1.0 - len(self.free_slots) / usable if usable > 0 else 0.0
        return blocks, slots

    def assert_all_free(self) -> None:
        assert not self.req_blocks and not self.req_slots, (
            f"leaked: blocks held by {sorted(self.req_blocks)}, slots held by {sorted(self.req_slots)}")
        assert self.block_pool.num_free == self.block_pool.num_blocks, "block pool is missing blocks"
        assert sorted(self.free_slots) == list(range(NULL_STATE_SLOT + 1, self.num_state_slots)), (
            "state slot pool is missing slots")
