"""KVCacheManager: MLA latent blocks and KDA recurrent-state slots per request.

Blocks grow with a request's length; KDA state slots are held for the request's whole life: one, or with
speculative decoding 1 + num_speculative_tokens checkpoint slots (the state after each verified token goes to
its own column, so a rejected draft leaves nothing to undo). Everything is returned on finish, abort and
preemption; `assert_all_free` is the invariant tests check after each run.

With prefix caching a request's confirmed full blocks are hashed (`cache_blocks`) and outlive it in the block
pool's LRU list; KDA state snapshots sit in state slots of their own (prefix_cache.SnapshotPool). `lookup` finds
the deepest cached prefix of a new request that has both, and `allocate_slots` hands its blocks over.
"""
from __future__ import annotations

from vllm.core.block_pool import BlockPool
from vllm.core.prefix_cache import CacheHit, SnapshotPool, hash_blocks
from vllm.core.request import Request


# Slot 0 of every state pool belongs to nobody: padding rows point at it, and FlashInfer's KDA kernels read
# slot 0 as "no state". Requests get slots 1..num_state_slots-1.
NULL_STATE_SLOT = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int, needs_blocks: bool,
                 needs_slots: bool, slots_per_request: int = 1, enable_prefix_caching: bool = False,
                 snapshot_slots: list[int] | range = ()) -> None:
        self.block_size = block_size
        self.needs_blocks, self.needs_slots = needs_blocks, needs_slots
        self.slots_per_request = slots_per_request
        self.snapshots = SnapshotPool(list(snapshot_slots))
        # A hybrid needs its snapshots to hit; a model without KDA layers hits on blocks alone.
        self.prefix_caching = enable_prefix_caching and (len(self.snapshots) > 0 or not needs_slots)
        self.block_pool = BlockPool(num_blocks, on_evict=self.snapshots.drop)
        self.num_state_slots = num_state_slots
        self.free_slots: list[int] = list(range(NULL_STATE_SLOT + 1, num_state_slots))[::-1]
        self.req_blocks: dict[str, list[int]] = {}
        self.req_slots: dict[str, list[int]] = {}
        # A fresh number each time a request's block list starts over (first allocation, or after a free): its
        # (request id, number) names one append-only list, which lets the input batch write only new entries.
        self.block_list_ids: dict[str, int] = {}
        self._next_list_id = 0
        self.num_cached_blocks: dict[str, int] = {}  # per request: its leading blocks registered in the pool
        self.decode_snapshot: dict[str, bytes] = {}  # per request: its latest decode snapshot's key

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        if not self.needs_blocks:
            return 0
        total = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(self.req_blocks.get(request.request_id, ())))

    def allocate_slots(self, request: Request, num_new_tokens: int, hit: CacheHit | None = None) -> bool:
        """Reserve cache room for `num_new_tokens` more tokens (and state slots); False if it does not fit. `hit`:
        a new request's cached prefix (lookup), whose blocks it takes before its new ones."""
        rid = request.request_id
        need_slot = self.needs_slots and rid not in self.req_slots
        if need_slot and len(self.free_slots) < self.slots_per_request:
            return False
        if hit is not None and hit.num_tokens:
            assert rid not in self.req_blocks, "a cache hit starts a request's block list"
            total = -(-(hit.num_tokens + num_new_tokens) // self.block_size) if self.needs_blocks else 0
            n = total - len(hit.blocks)
            # Cached blocks no one holds sit in the free list: taking them leaves fewer to allocate from.
            taken = sum(self.block_pool.ref_cnt[b] == 0 for b in hit.blocks)
            if n > self.block_pool.num_free - taken:
                return False
            self.block_pool.touch(hit.blocks)
            self.req_blocks[rid] = list(hit.blocks)
            self.num_cached_blocks[rid] = len(hit.blocks)
            self._next_list_id += 1
            self.block_list_ids[rid] = self._next_list_id
        else:
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
        rid = request.request_id
        self.block_pool.free(self.req_blocks.pop(rid, []))
        self.block_list_ids.pop(rid, None)
        self.num_cached_blocks.pop(rid, None)
        self.decode_snapshot.pop(rid, None)
        self.free_slots.extend(self.req_slots.pop(rid, []))

    # ---- prefix caching ---------------------------------------------------------------------------------------
    def lookup(self, request: Request) -> CacheHit:
        """The deepest cached prefix of the request's tokens that leaves at least its last token to compute: a
        run of cached blocks, ending (with KDA layers) where a snapshot was taken."""
        bs = self.block_size
        limit = (request.num_tokens - 1) // bs
        hashes = self._hashes(request, limit)[:limit]
        blocks = self.block_pool.lookup(hashes) if self.needs_blocks else []
        m = len(blocks) if self.needs_blocks else limit
        if not self.needs_slots:
            return CacheHit(m * bs, blocks, None, m)
        entries = self.snapshots.entries
        cached = m if self.needs_blocks else 0  # without MLA layers no run of blocks says a prefix was seen
        for i in range(m, 0, -1):
            if hashes[i - 1] in entries:
                return CacheHit(i * bs, blocks[:i], self.snapshots.get(hashes[i - 1]), max(cached, i))
        return CacheHit(0, [], None, cached)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Registers the request's full blocks among its first `num_tokens` tokens, whose cache is final."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if not self.prefix_caching or not blocks:
            return
        n = min(num_tokens // self.block_size, len(blocks))
        done = self.num_cached_blocks.get(rid, 0)
        if n <= done:
            return
        hashes = self._hashes(request, n)
        for i in range(done, n):
            self.block_pool.cache(blocks[i], hashes[i])
        self.num_cached_blocks[rid] = n

    def reserve_snapshot(self) -> int | None:
        """A snapshot slot for a step to copy a state into (None: every slot is pending)."""
        return self.snapshots.reserve()

    def commit_snapshot(self, request: Request, position: int, slot: int, decoding: bool) -> None:
        """The state at `position` (a block boundary) is in `slot`: cache it with the blocks before it. A
        decoding request's previous decode snapshot becomes the first to evict."""
        key = self._hashes(request, position // self.block_size)[position // self.block_size - 1]
        self.snapshots.commit(slot, key)
        self.cache_blocks(request, position)
        if decoding:
            previous = self.decode_snapshot.get(request.request_id)
            if previous is not None and previous != key:
                self.snapshots.demote(previous)
            self.decode_snapshot[request.request_id] = key

    def discard_snapshot(self, slot: int) -> None:
        self.snapshots.discard(slot)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block hash and snapshot; blocks in use stay with their requests."""
        self.block_pool.reset()
        self.snapshots.reset()
        self.num_cached_blocks = dict.fromkeys(self.num_cached_blocks, 0)
        self.decode_snapshot.clear()
        return True

    def _hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        if len(request.block_hashes) < num_blocks:
            hash_blocks(request.all_token_ids(), self.block_size, request.block_hashes, num_blocks)
        return request.block_hashes

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
        assert self.block_pool.num_free == self.block_pool.num_blocks and not any(self.block_pool.ref_cnt), \
            "block pool is missing blocks"
        assert sorted(self.free_slots) == list(range(NULL_STATE_SLOT + 1, self.num_state_slots)), (
            "state slot pool is missing slots")
        self.snapshots.assert_all_free()
