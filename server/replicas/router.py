"""Ray Serve's request router for the engine replicas: prefix_table's choice over Ray's replicas.

Ray calls `choose_replicas` for each request (in the front's process) with the replicas
that are up; the loads are Ray's own counts of each replica's ongoing requests, cached or
probed. The request's RouteHint travels as the `route` keyword of the call.
The router names one replica; if it has no room (or cannot be reached), Ray asks again
after a backoff, with the loads it has learned meanwhile.
"""

from __future__ import annotations

import collections
import logging
from typing import Optional

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from .prefix_table import PrefixTable, RouteHint, RoutingPolicy, choose

log = logging.getLogger("kiln.replicas")

ROUTING_KEYWORD = "route"
PINNED_KEYS = 100_000  # request keys remembered (oldest forgotten first)
# The routers in this process by deployment name, so the front's /metrics can read their counts.
ROUTERS: dict[str, "PrefixAffinityRouter"] = {}


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, **policy):
        self.policy = RoutingPolicy(**policy)
        self.table = PrefixTable(self.policy.pages_per_replica)
        self.turn = 0
        self.last_loads: dict[ReplicaID, int] = {}  # each replica's latest known ongoing requests
        self.pinned: collections.OrderedDict[str, ReplicaID] = collections.OrderedDict()  # key -> its replica
        self.matched: dict[str, int] = {}  # request -> pages its replica held when chosen, until routed
        self.routed: collections.Counter[str] = collections.Counter()  # requests per replica
        self.matched_pages = 0  # leading pages the chosen replica held, by the table
        self.prompt_pages = 0
        if self._deployment_id is not None:
            # Through the module as this process imported it: Ray ships this class by value,
            # with a copy of the module's globals that nobody else sees.
            from kiln.server.replicas import router as registry

            registry.ROUTERS[self._deployment_id.name] = self

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        hint = _hint(pending_request)
        by_id = {r.replica_id: r for r in candidate_replicas}
        pinned = self.pinned.get(hint.follows) if hint.follows is not None else None
        if pinned in by_id:  # where the request it follows went, even when that replica is busy
            return [[by_id[pinned]]]
        loads = await self._loads(candidate_replicas)
        hashes = list(hint.page_hashes)
        chosen = choose(self.policy, self.table, hashes, loads, self.turn)[0]
        self.turn += 1
        # Recorded now, not once routed: a request with the same prefix chosen meanwhile goes there too.
        if pending_request is not None:
            self.matched[pending_request.metadata.internal_request_id] = self.table.matched_pages(chosen, hashes)
            while len(self.matched) > PINNED_KEYS:  # requests cancelled before Ray routed them
                self.matched.pop(next(iter(self.matched)))
        self.table.record(chosen, hashes)
        return [[by_id[chosen]]]

    async def _loads(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Each replica's ongoing requests: Ray's cached count, probed where it has none, and the
        last one known where a probe went unanswered (a busy replica answers late; it is still the
        one holding its prefixes, and Ray will not send it more than it has room for)."""
        loads, unknown = {}, []
        for replica in replicas:
            queued = self._replica_queue_len_cache.get(replica.replica_id)
            if queued is None:
                unknown.append(replica)
            else:
                loads[replica.replica_id] = queued
        if unknown:
            for replica, queued in await self._probe_queue_lens(unknown, 0):
                if queued is not None:
                    loads[replica.replica_id] = queued
        for replica in replicas:
            loads.setdefault(replica.replica_id, self.last_loads.get(replica.replica_id, 0))
        self.last_loads.update(loads)
        return loads

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        hint = _hint(pending_request)
        if hint.key is not None:
            self.pinned[hint.key] = replica_id
            self.pinned.move_to_end(hint.key)
            if len(self.pinned) > PINNED_KEYS:
                self.pinned.popitem(last=False)
        self.routed[replica_id.unique_id] += 1
        self.matched_pages += self.matched.pop(pending_request.metadata.internal_request_id, 0)
        self.prompt_pages += len(hint.page_hashes)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current = {r.replica_id for r in replicas}
        for replica_id in current:
            self.table.add_replica(replica_id)
        for replica_id in self.table.replicas():
            if replica_id not in current:
                self.table.remove_replica(replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.remove_replica(replica_id)
        self.last_loads.pop(replica_id, None)


def _hint(pending_request: Optional[PendingRequest]) -> RouteHint:
    hint = pending_request.kwargs.get(ROUTING_KEYWORD) if pending_request is not None else None
    return RouteHint() if hint is None else hint
