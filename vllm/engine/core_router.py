"""Which front end owns each request, for an engine core serving several (`vllm serve --api-server-count N`:
N API server processes over one core, upstream's `client_index`).

The core's records name child requests (`request_id`, or `request_id-i` for n > 1), so the router keeps each
child's parent and each parent's front end from the ADD until the last child finishes: by a record that carries a
finish, a FINISH from its front end, a rejection, or its front end going away. A front end can abort or finish
only its own requests; a request id another front end holds is refused as the engine refuses any id in use.
"""
from __future__ import annotations

from vllm.engine.core_outputs import CoreRecord

Routed = dict[int, tuple[list[CoreRecord], list[tuple[str, Exception]]]]


class ClientRouter:
    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients
        self.owner: dict[str, int] = {}  # parent request id -> client index
        self.parent_of: dict[str, str] = {}  # unfinished child id -> parent id
        self.children: dict[str, list[str]] = {}  # parent id -> its children
        self.unfinished: dict[str, int] = {}  # parent id -> how many of them are unfinished

    def add(self, client: int, request_id: str, child_ids: list[str]) -> None:
        if self.num_clients == 1:  # one front end owns everything: nothing to keep
            return
        self.owner[request_id] = client
        self.children[request_id] = child_ids
        self.unfinished[request_id] = len(child_ids)
        for cid in child_ids:
            self.parent_of[cid] = request_id

    def owns(self, client: int, request_id: str) -> bool:
        return self.num_clients == 1 or self.owner.get(request_id) == client

    def requests_of(self, client: int) -> list[str]:
        return [rid for rid, c in self.owner.items() if c == client]

    def own_children(self, client: int, finished: list[tuple]) -> list[tuple]:
        """The FINISH entries (child_id, kept, status) of `client`'s own children, now counted as finished."""
        if self.num_clients == 1:
            return finished
        mine = [f for f in finished if self.owner.get(self.parent_of.get(f[0], ""), -1) == client]
        for f in mine:
            self._child_done(f[0])
        return mine

    def route(self, records: list[CoreRecord], rejected: list[tuple[str, Exception]]) -> Routed:
        """Each client's records and rejections; the finished children and rejected parents are forgotten."""
        if self.num_clients == 1:
            return {0: (records, rejected)} if records or rejected else {}
        out: Routed = {}
        for rec in records:
            parent = self.parent_of.get(rec[0])
            if parent is None:  # its front end went away (its requests were aborted then)
                continue
            client = self.owner[parent]
            out.setdefault(client, ([], []))[0].append(rec)
            if rec[4] is not None:  # finish
                self._child_done(rec[0])
        for rid, error in rejected:
            client = self.owner.get(rid)
            if client is not None:
                out.setdefault(client, ([], []))[1].append((rid, error))
                self.forget(rid)
        return out

    def forget(self, request_id: str) -> None:
        """Drops a parent and its children (rejected, or its front end is gone)."""
        if self.owner.pop(request_id, None) is None:
            return
        self.unfinished.pop(request_id, None)
        for cid in self.children.pop(request_id, ()):
            self.parent_of.pop(cid, None)

    def _child_done(self, child_id: str) -> None:
        parent = self.parent_of.pop(child_id)
        self.unfinished[parent] -= 1
        if self.unfinished[parent] == 0:
            del self.unfinished[parent], self.owner[parent], self.children[parent]
