"""The prefix cache's bookkeeping, without a model: chained block hashes, the block pool's reference counts and LRU
order, snapshots evicted with their blocks, lookups that stop at the deepest snapshot and leave a token to
compute, and the scheduler's snapshot positions (prompt cuts, decode boundaries)."""
from __future__ import annotations

import numpy as np

from vllm.core.block_pool import BlockPool
from vllm.core.kv_cache_manager import KVCacheManager
from vllm.core.prefix_cache import SnapshotPool, hash_blocks
from vllm.core.request import Request
from vllm.core.scheduler import Scheduler
from vllm.config import SchedulerConfig
from vllm.sampling_params import SamplingParams

BS = 4


def _req(rid: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), max_tokens)


def test_block_hashes_chain_so_equal_hashes_mean_equal_prefixes():
    a = hash_blocks(np.array([1, 2, 3, 4, 5, 6, 7, 8]), BS, [], 2)
    b = hash_blocks(np.array([9, 9, 9, 9, 5, 6, 7, 8]), BS, [], 2)
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different history
    assert hash_blocks(np.array([1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0]), BS, list(a[:1]), 3)[:2] == a


def test_the_pool_hands_out_unhashed_blocks_first_then_the_least_recently_freed():
    pool = BlockPool(6)
    x, y = pool.allocate(3), pool.allocate(2)
    for i, b in enumerate(x):
        pool.cache(b, bytes([i]))
    pool.free(x)  # hashed: kept, deepest first in eviction order
    pool.free(y)  # unhashed: handed out before any hashed block
    assert pool.num_free == 6
    assert pool.allocate(3) == [y[0], y[1], 5]
    assert pool.allocate(1) == [x[2]] and pool.lookup([b"\0", b"\1", b"\2"]) == x[:2]
    pool.touch(x[:2])  # a hit takes cached free blocks out of the free list
    assert pool.num_free == 0 and pool.ref_cnt[x[0]] == 1


def test_evicting_a_block_drops_the_snapshot_keyed_by_it():
    snaps = SnapshotPool([10, 11])
    pool = BlockPool(2, on_evict=snaps.drop)
    (b,) = pool.allocate(1)
    pool.cache(b, b"h")
    slot = snaps.reserve()
    snaps.commit(slot, b"h")
    pool.free([b])
    assert snaps.get(b"h") == slot
    pool.allocate(2)  # the unhashed block first, then the cached one: evicted
    assert snaps.get(b"h") is None and pool.num_evicted == 1
    snaps.assert_all_free()


def test_snapshot_slots_evict_lru_but_never_pending():
    snaps = SnapshotPool([1, 2])
    a, b = snaps.reserve(), snaps.reserve()
    assert snaps.reserve() is None  # both pending
    snaps.commit(a, b"a")
    snaps.commit(b, b"b")
    snaps.get(b"a")  # a is now the most recent
    assert snaps.reserve() == b and snaps.num_evicted == 1
    snaps.discard(b)
    snaps.assert_all_free()


def _kv(num_blocks=16, snapshots=4) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, 1 + 2, needs_blocks=True, needs_slots=True, enable_prefix_caching=True,
                          snapshot_slots=range(3, 3 + snapshots))


def test_a_lookup_stops_at_the_deepest_snapshot_and_leaves_a_token_to_compute():
    kv = _kv()
    first = _req("a", list(range(1, 14)))  # 13 tokens: 3 full blocks before the last token
    assert kv.allocate_slots(first, 13)
    first.num_computed_tokens = 13
    kv.cache_blocks(first, 13)
    slot = kv.reserve_snapshot()
    kv.commit_snapshot(first, 8, slot, decoding=False)
    kv.free(first)
    same = _req("b", list(range(1, 14)))
    hit = kv.lookup(same)
    assert (hit.num_tokens, hit.snapshot, hit.num_cached_blocks) == (8, slot, 3)
    assert kv.allocate_slots(same, 5, hit) and kv.block_ids("b")[:2] == hit.blocks
    short = _req("c", list(range(1, 9)))  # 8 tokens: its last token must be computed, so at most 4 cached
    assert kv.lookup(short).num_tokens == 0  # no snapshot at 4
    kv.free(same)
    kv.assert_all_free()


def _scheduler(num_blocks=32) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), _kv(num_blocks),
                     snapshot_interval=8)


def _decode_until(sched: Scheduler, req: Request, num_tokens: int) -> list[int]:
    positions = []
    while req.num_tokens < num_tokens:
        out = sched.schedule()
        positions += [s.position for s in out.saves]
        sched.update_from_output(out, {req.request_id: [7]}, [True] * len(out.saves))
    return positions


def test_a_decoding_request_saves_past_its_prompt_then_every_interval():
    sched = _scheduler()
    req = _req("a", list(range(1, 20)), max_tokens=16)  # 19 tokens: no cut, the first snapshot at 20
    sched.add_request(req)
    assert _decode_until(sched, req, 30) == [20, 28] and req.next_snapshot == 36
    assert len(sched.kv.snapshots.entries) == 2
    sched.finish(req, req.status.FINISHED_ABORTED)
    sched.kv.assert_all_free()


def test_a_boundary_passed_without_a_free_slot_does_not_stop_later_snapshots():
    sched = _scheduler()
    held = [sched.kv.reserve_snapshot() for _ in range(4)]  # every snapshot slot pending elsewhere
    req = _req("a", list(range(1, 20)), max_tokens=16)
    sched.add_request(req)
    assert _decode_until(sched, req, 22) == []  # 20 passed with no slot to save into
    for slot in held:
        sched.kv.discard_snapshot(slot)
    assert _decode_until(sched, req, 30) == [28]
    sched.finish(req, req.status.FINISHED_ABORTED)
    sched.kv.assert_all_free()


def test_a_prompt_is_cut_where_a_shared_run_of_cached_blocks_ends():
    sched = _scheduler()
    first = _req("a", list(range(1, 21)), max_tokens=2)  # ends on a block boundary: its state is kept at 20
    sched.add_request(first)
    out = sched.schedule()
    assert out.scheduled[0].num_tokens == 20 and [(s.position, s.prefill) for s in out.saves] == [(20, True)]
    sched.update_from_output(out, {"a": [7]}, [True])
    sched.finish(first, first.status.FINISHED_ABORTED)
    other = _req("b", list(range(1, 13)) + [99] * 10, max_tokens=2)  # shares 3 blocks, then departs
    sched.add_request(other)
    out = sched.schedule()  # no snapshot inside the shared 12 tokens: cut there (12 >= the interval of 8)
    assert out.scheduled[0].num_tokens == 12 and [s.position for s in out.saves] == [12]
    sched.update_from_output(out, {}, [True])
    third = _req("c", list(range(1, 13)) + [55] * 5, max_tokens=2)
    assert sched.kv.lookup(third).num_tokens == 12
