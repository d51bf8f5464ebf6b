"""ClientRouter: a core serving several front ends (`vllm serve --api-server-count N`) sends each its own records
and rejections, lets each abort and finish only its own requests, and forgets a request once its last child has
finished, however it finished."""
from __future__ import annotations

from vllm.engine.core_router import ClientRouter


def rec(child_id: str, finish: str | None = None) -> tuple:
    return (child_id, [7], None, None, finish, None, 0, 0.0, 0, None, None)


def test_records_and_rejections_go_to_their_owner_and_finished_requests_are_forgotten():
    r = ClientRouter(2)
    r.add(0, "a", ["a"])
    r.add(1, "b", ["b-0", "b-1"])
    r.add(1, "c", ["c"])
    error = RuntimeError("step failed")
    routed = r.route([rec("a"), rec("b-1", "stop"), rec("b-0"), rec("gone")], [("c", error)])
    assert routed == {0: ([rec("a")], []), 1: ([rec("b-1", "stop"), rec("b-0")], [("c", error)])}
    assert r.requests_of(1) == ["b"]  # c was rejected; b has a child left
    assert r.route([rec("b-0", "length"), rec("a", "abort")], []) == {1: ([rec("b-0", "length")], []),
                                                                      0: ([rec("a", "abort")], [])}
    assert r.owner == r.parent_of == r.children == r.unfinished == {}


def test_a_front_end_aborts_and_finishes_only_its_own_requests():
    r = ClientRouter(3)
    r.add(0, "a", ["a-0", "a-1"])
    r.add(2, "z", ["z"])
    assert r.owns(0, "a") and not r.owns(2, "a") and not r.owns(1, "nobody")
    finished = [("a-0", 3, "stop"), ("z", 1, "stop"), ("unknown", 1, "stop")]
    assert r.own_children(0, finished) == [("a-0", 3, "stop")]
    assert r.own_children(0, finished) == []  # counted once: a-0 is no longer unfinished
    assert r.own_children(2, finished) == [("z", 1, "stop")]
    assert r.requests_of(0) == ["a"] and r.requests_of(2) == []
    r.forget("a")
    assert r.owner == r.parent_of == r.children == r.unfinished == {}


def test_one_front_end_owns_everything_with_no_bookkeeping():
    r = ClientRouter(1)
    r.add(0, "a", ["a"])
    assert r.owner == {} and r.owns(0, "anything")
    assert r.route([rec("a", "stop")], []) == {0: ([rec("a", "stop")], [])}
    assert r.route([], []) == {}
    assert r.own_children(0, [("a", 1, "stop")]) == [("a", 1, "stop")]
